"""What the routing-replay tests share: the tiny GLM-5.2 engine with replay on, a GRPO batch, verl's passes, and
a watch on what every router really chose (tests_npu/engine/test_router_replay.py, one process, and
tests_npu/support/router_replay_parallel.py, a rank of a gloo run).

The watch identifies a router row's token by megatron's layout, stated here independently of the code under
test: the model embeds ``[batch, seq]`` input as ``[seq, batch]`` rows (row = position x batch + sample) and
sequence parallelism gives tensor-parallel rank ``r`` of ``n`` the ``r``-th contiguous block of positions. A
micro-batch row's sample is the one whose tokens the row starts with.
"""

from __future__ import annotations

import functools

import torch

SEQ, PROMPT, BATCH, TOPK, EXPERTS = 32, 16, 4, 2, 4
PROMPT_PADS = (0, 3, 6, 1)
RESPONSE_LENGTHS = (16, 9, 4, 12)


def gpt_of(engine):
    inner = engine.module[0]
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def replay_engine(
    model_dir, mode: str, *, pad_to_minibatch_max: bool = True, tp: int = 1, ep: int = 1, pp: int = 1,
    recompute: bool = False,
):  # fmt: skip
    # the GLM-5.2 example's activation recompute: every layer recomputed in the backward
    recompute_settings = (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute else {}
    )
    from megatron.core import tensor_parallel
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine import EngineRegistry

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=str(model_dir)),
        engine_config=McoreEngineConfig(
            forward_only=False, vanilla_mbridge=True, use_remove_padding=False, param_offload=True,
            optimizer_offload=True, router_replay=EngineRouterReplayConfig(mode=mode),
            pad_bshd_to_minibatch_max=pad_to_minibatch_max, tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
            override_transformer_config={
                "use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                # verl_npu's RMSNorm: torch's norm refuses sequence parallelism
                "use_fused_rmsnorm": True, "moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False,
                **recompute_settings,
            },
        ),
        optimizer_config=McoreOptimizerConfig(lr=1e-2, lr_decay_steps=10),
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    engine.initialize()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return engine


def routers_of(engine) -> dict[int, torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return {m.layer_number: m for m in gpt_of(engine).modules() if isinstance(m, TopKRouter)}


class RouteWatch:
    """Every forward of the model: the token ids it was given ``[batch, seq]`` and each router's routing maps
    ``[seq * batch, experts]`` (megatron's rows: position-major): the forward's, then, under activation
    recompute, the backward's recomputed one."""

    def __init__(self, engine):
        from megatron.core import parallel_state as mpu

        self.calls: list[dict] = []
        self.expert_counts: list[torch.Tensor] = []
        sequence_parallel = gpt_of(engine).config.sequence_parallel
        self._tp_rank = mpu.get_tensor_model_parallel_rank() if sequence_parallel else 0
        self._tp_size = mpu.get_tensor_model_parallel_world_size() if sequence_parallel else 1
        self._handles = [gpt_of(engine).register_forward_pre_hook(self._model_call, with_kwargs=True)]
        for number, router in routers_of(engine).items():
            self._handles.append(router.register_forward_hook(functools.partial(self._routed, number)))

    def _model_call(self, module, args, kwargs):
        self.calls.append({"input_ids": kwargs["input_ids"].detach().cpu().clone(), "maps": {}})

    def _routed(self, number, module, args, output):
        self.calls[-1]["maps"].setdefault(number, []).append(output[1].detach().cpu().clone())

    def close(self):
        for handle in self._handles:
            handle.remove()

    def routes(self, samples: list[torch.Tensor]) -> dict[tuple[int, int, int], tuple[int, ...]]:
        """(sample, position, layer number) -> the experts chosen for that real token (``("inconsistent",)`` where
        a recompute chose differently from its forward), and every row's expert count. Each micro-batch row is
        matched to the one sample whose tokens it starts with."""
        chosen, self.expert_counts = {}, []
        for call in self.calls:
            ids = call["input_ids"]
            batch, seq = ids.shape
            local = seq // self._tp_size  # positions on this rank: [first, first + local)
            first = self._tp_rank * local
            for routing_map in (m for maps in call["maps"].values() for m in maps):
                assert routing_map.shape[0] == local * batch, (routing_map.shape, ids.shape, self._tp_size)
                self.expert_counts.append(routing_map.sum(-1))
            for row in range(batch):
                matches = [k for k, s in enumerate(samples) if len(s) <= seq and torch.equal(ids[row, : len(s)], s)]
                assert len(matches) == 1, f"micro-batch row {row} matches samples {matches}"
                sample = matches[0]
                for number, maps in call["maps"].items():
                    for position in range(first, min(first + local, len(samples[sample]))):
                        seen = {tuple(m[(position - first) * batch + row].nonzero().flatten().tolist()) for m in maps}
                        chosen[sample, position, number] = seen.pop() if len(seen) == 1 else ("inconsistent",)
        return chosen


def make_batch(seed: int, **settings):
    """Four sequences of a GRPO batch (left-padded prompts, right-padded responses), as verl's engine takes them."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 128, (BATCH, SEQ), generator=generator)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    for row in range(BATCH):
        mask[row, PROMPT_PADS[row] : PROMPT + RESPONSE_LENGTHS[row]] = 1
    input_ids = input_ids * mask
    responses = input_ids[:, PROMPT:]
    fields = {
        "input_ids": input_ids, "prompts": input_ids[:, :PROMPT], "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask), "responses": responses,
        "response_mask": mask[:, PROMPT:], "old_log_probs": torch.zeros_like(responses, dtype=torch.float32),
        "advantages": torch.randn(responses.shape, generator=generator),
    }  # fmt: skip
    extra = settings.pop("routed_experts", None)
    if extra is not None:
        fields["routed_experts"] = extra
    td = left_right_2_no_padding(DataProto.from_single_dict(fields, meta_info={"temperature": 1.0}).to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=BATCH, calculate_entropy=False, **settings)
    samples = [input_ids[row][mask[row].bool()] for row in range(BATCH)]
    return td, samples, (input_ids, mask)


def log_prob_pass(engine, td):
    """verl's compute_log_prob with routing replay on (engine_workers marks the batch)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, enable_routing_replay=True)
    with engine.eval_mode():
        return engine.infer_batch(td)["model_output"]


def update_pass(engine, td):
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    tu.assign_non_tensor(td, enable_routing_replay=True)
    loss = functools.partial(
        ppo_loss, config=ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    )
    with engine.train_mode():
        return engine.train_batch(td, loss)


def perturb_routers(engine, seed: int) -> None:
    """New router weights, as an update between the passes would leave them (larger, so most choices change)."""
    generator = torch.Generator().manual_seed(seed)
    with engine._offloader().resident(["params"]), torch.no_grad():
        for router in routers_of(engine).values():
            router.weight.add_(torch.randn(router.weight.shape, generator=generator).to(router.weight) * 0.5)


def moe_ordinal(engine) -> dict[int, int]:
    """Layer number -> its index in R2's recorded routes (MoE layers only, in order)."""
    return {number: i for i, number in enumerate(sorted(routers_of(engine)))}


def recorded_routes(routed_experts, samples, ordinal) -> dict[tuple[int, int, int], tuple[int, ...]]:
    per_sample = routed_experts.unbind()
    assert [len(r) for r in per_sample] == [len(s) for s in samples], "a route row per real token"
    return {
        (k, p, number): tuple(sorted(per_sample[k][p, i].tolist()))
        for k, sample in enumerate(samples)
        for p in range(len(sample))
        for number, i in ordinal.items()
    }


def rows_without_topk_experts(watch: RouteWatch) -> int:
    counts = torch.cat(watch.expert_counts)
    return int((counts != TOPK).sum())


def differing(a: dict, b: dict) -> int:
    """How many of the token x layer choices in ``b`` differ from ``a``'s (a rank sees only its positions)."""
    assert b.keys() <= a.keys() and b, (len(a), len(b))
    return sum(a[key] != b[key] for key in b)


def rollout_routes(samples, route_layers: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Routes as verl's agent loop hands the rollout's to training: the engine returns one row per token it fed
    (prompt and response, all but the final token), placed from the left-padded prompt's first token into a
    zero ``[batch, seq, layers, topk]`` (verl/experimental/agent_loop/agent_loop.py). Each row holds ``topk``
    distinct experts that are not the model's own choice in general."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.zeros(BATCH, SEQ, route_layers, TOPK, dtype=torch.int16)
    per_sample = []
    for row, sample in enumerate(samples):
        fed = len(sample) - 1
        routes = torch.rand(fed, route_layers, EXPERTS, generator=generator).argsort(-1)[..., :TOPK].to(torch.int16)
        dense[row, PROMPT_PADS[row] : PROMPT_PADS[row] + fed] = routes
        per_sample.append(routes)
    return dense, per_sample


def watched(engine, run):
    """(what ``run()`` returned, the watch of the forwards it made)."""
    watch = RouteWatch(engine)
    try:
        return run(), watch
    finally:
        watch.close()


def r2_scenario(engine, seed: int, log_prob_split: dict) -> dict[str, int]:
    """R2 as a training step runs it: record in the log-prob pass (split ``log_prob_split``), the routers
    perturbed, replay in the update (micro-batch 1). Counts of token x layer choices."""
    td, samples, _ = make_batch(seed, **log_prob_split)
    output, watch = watched(engine, lambda: log_prob_pass(engine, td))
    recorded = recorded_routes(output["routed_experts"], samples, moe_ordinal(engine))
    record_wrong = differing(recorded, watch.routes(samples))

    perturb_routers(engine, seed)

    def native_pass():
        with engine.eval_mode():
            engine.infer_batch(make_batch(seed, use_dynamic_bsz=False, micro_batch_size_per_gpu=BATCH)[0])

    _, native = watched(engine, native_pass)
    update_td = make_batch(seed, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)[0]
    update_td["routed_experts"] = output["routed_experts"]
    _, watch = watched(engine, lambda: update_pass(engine, update_td))
    replayed = watch.routes(samples)
    return {
        "router_calls_per_forward": max(len(maps) for call in watch.calls for maps in call["maps"].values()),
        "choices": len(replayed),
        "record_wrong": record_wrong,
        "changed_without_replay": differing(recorded, native.routes(samples)),
        "replay_wrong": differing(recorded, replayed),
        "rows_lacking_experts": rows_without_topk_experts(watch),
    }


def r3_scenario(engine, seed: int, route_layers: int) -> dict[str, int]:
    """R3: the rollout's routes (``route_layers`` per token: the MoE layers, or every layer) replayed in the
    update, micro-batch 2. Counts over every real token but each sample's final one."""
    samples = make_batch(seed)[1]
    dense, handed = rollout_routes(samples, route_layers, seed=seed + route_layers)
    td = make_batch(seed, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, routed_experts=dense)[0]
    _, watch = watched(engine, lambda: update_pass(engine, td))
    used = watch.routes(samples)
    numbers = sorted(routers_of(engine))
    # verl's rule: routes of the MoE layers only are indexed by ordinal, routes of every layer by layer number - 1
    index = {n: i for i, n in enumerate(numbers)} if route_layers == len(numbers) else {n: n - 1 for n in numbers}
    expected = {
        (k, p, n): tuple(sorted(handed[k][p, i].tolist()))
        for k, sample in enumerate(samples)
        for p in range(len(sample) - 1)
        for n, i in index.items()
    }
    replayable = {key: value for key, value in used.items() if key in expected}
    return {
        "choices": len(replayable),
        "replay_wrong": differing(expected, replayable),
        "rows_lacking_experts": rows_without_topk_experts(watch),
    }
