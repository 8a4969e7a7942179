"""verl 0.9.1's own engine API drives our registered engine end to end, on the CPU harness.

EngineRegistry picks NPUMegatronEngineWithLMHead for (npu, huawei); ``initialize()`` builds a tiny
Qwen2 through verl's mbridge path on megatron-core's local spec with verl_npu's RMSNorm and loads
the HF weights; ``train_batch`` runs inside verl's ``train_mode()`` context, which offloads and
onloads through our manager when param/optimizer offload is on; checkpoints save and restore
whether the state is offloaded or was never offloaded.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")
SEQ, PROMPT = 32, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # norms that are not all ones: a norm loaded under the wrong name would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1").save_pretrained(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def select_npu_engine():
    import verl_npu.megatron_adaptor as layer

    saved = {k: os.environ.get(k) for k in ("VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR")}
    os.environ.update(VERL_ENGINE_DEVICE="npu", VERL_ENGINE_VENDOR="huawei")
    layer.load()
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def new_engine(model_dir, *, offload: bool, remove_padding: bool = False):
    from megatron.core import tensor_parallel
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=str(model_dir)),
        engine_config=McoreEngineConfig(
            forward_only=False, vanilla_mbridge=True, use_remove_padding=remove_padding,
            param_offload=offload, optimizer_offload=offload,
            override_transformer_config={
                "use_fused_rmsnorm": True, "use_cpu_initialization": True, "hidden_dropout": 0.0,
                "attention_dropout": 0.0,
            },
        ),
        optimizer_config=McoreOptimizerConfig(lr=1e-2, lr_decay_steps=10),
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    engine.initialize()
    tensor_parallel.model_parallel_cuda_manual_seed(1)  # megatron seeds its RNG tracker only when CUDA is up
    return engine


def batch(seed: int, **extra):
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask, create_random_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    torch.manual_seed(seed)
    input_ids = torch.randint(0, 128, (4, SEQ))
    mask = create_random_mask(
        input_ids=input_ids, max_ratio_of_valid_token=0.8, max_ratio_of_left_padding=0.2, min_ratio_of_valid_token=0.6
    )
    responses = input_ids[:, PROMPT:]
    fields = {
        "input_ids": input_ids, "prompts": input_ids[:, :PROMPT], "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask), "responses": responses,
        "response_mask": mask[:, PROMPT:], "old_log_probs": torch.zeros_like(responses, dtype=torch.float32),
        "advantages": torch.randn_like(responses, dtype=torch.float32),
    }  # fmt: skip
    data = DataProto.from_single_dict(fields, meta_info={"temperature": 1.0})
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=4, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, **extra)
    return td, (input_ids, mask)


def train_step(engine, step: int) -> list[float]:
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    actor = ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=2)
    loss = functools.partial(ppo_loss, config=actor)
    with engine.train_mode():  # verl's context: onload on entry, offload on exit when offload is on
        out = engine.train_batch(batch(100 + step)[0], loss)
    metrics = out["metrics"]
    return [*metrics["actor/pg_loss"].values, metrics["grad_norm"]]


def offloaded(engine) -> bool:
    manager = engine._offload_manager
    return manager is not None and all(manager.on_host(kind) for kind in ("params", "grads", "optimizer"))


def test_verl_builds_our_engine_on_the_local_spec_and_matches_the_hf_model(model_dir):
    from transformers import Qwen2ForCausalLM
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_npu.engine.modules import RMSNorm
    from verl_npu.engine.verl_engine import NPUMegatronEngineWithLMHead

    engine = new_engine(model_dir, offload=False)
    assert type(engine) is NPUMegatronEngineWithLMHead
    # offload off: no manager, so no host arena is pinned beside the passes (verl's init calls to() with nothing)
    assert engine._offload_manager is None
    assert next(iter(engine.get_per_tensor_param()[0]))[1].device == next(engine.module[0].parameters()).device
    assert engine._offload_manager is None
    gpt = engine.module[0].module.module
    assert isinstance(gpt.decoder.layers[0].input_layernorm, RMSNorm) and isinstance(
        gpt.decoder.final_layernorm, RMSNorm
    )
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    hf_norm = hf.model.layers[1].post_attention_layernorm.weight
    assert torch.equal(gpt.decoder.layers[1].pre_mlp_layernorm.weight.detach(), hf_norm.detach())

    td, (input_ids, mask) = batch(7, calculate_entropy=False)
    ours = no_padding_2_padding(tu.get(engine.infer_batch(td)["model_output"], "log_probs"), td).float()
    with torch.no_grad():
        logits = hf(input_ids, attention_mask=mask).logits[:, PROMPT - 1 : -1].float()
    theirs = torch.log_softmax(logits, -1).gather(-1, input_ids[:, PROMPT:, None]).squeeze(-1)
    valid = mask[:, PROMPT:].bool()
    assert (ours[valid] - theirs[valid]).abs().max() < 0.1, "engine log-probs differ from the HF model's"


def test_verls_packed_thd_path_gives_the_padded_paths_log_probs(model_dir):
    """use_remove_padding=True (verl's default) packs each micro-batch into THD for our attention."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td, (_, mask) = batch(8, calculate_entropy=False)
    log_probs = {}
    for remove_padding in (False, True):
        engine = new_engine(model_dir, offload=False, remove_padding=remove_padding)
        out = engine.infer_batch(td.clone())["model_output"]
        log_probs[remove_padding] = no_padding_2_padding(tu.get(out, "log_probs"), td).float()
    valid = mask[:, PROMPT:].bool()
    assert (log_probs[True][valid] - log_probs[False][valid]).abs().max() < 0.02


def test_training_through_verls_api_with_offload_equals_training_without(model_dir):
    reference = new_engine(model_dir, offload=False)
    expected = [train_step(reference, step) for step in range(3)]
    engine = new_engine(model_dir, offload=True)
    assert offloaded(engine), "initialize() with param/optimizer offload leaves the state on the host"
    got = []
    for step in range(3):
        got.append(train_step(engine, step))
        assert offloaded(engine)
    assert got == expected


def test_checkpoint_save_while_offloaded_or_never_offloaded_restores_and_resumes(model_dir, tmp_path):
    never = new_engine(model_dir, offload=False)
    train_step(never, 0)
    never.save_checkpoint(str(tmp_path / "never"), global_step=1)  # no host copies exist: must not need them
    engine = new_engine(model_dir, offload=True)
    train_step(engine, 0)
    assert offloaded(engine)
    engine.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    assert offloaded(engine), "saving puts the state back where it was"
    after_save = [train_step(engine, step) for step in (1, 2)]
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert offloaded(engine)
    assert [train_step(engine, step) for step in (1, 2)] == after_save
    # resume in a new process: a fresh engine whose optimizer has never stepped
    fresh = new_engine(model_dir, offload=True)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert offloaded(fresh)
    assert [train_step(fresh, step) for step in (1, 2)] == after_save


def test_a_save_stages_in_the_offload_arenas_and_writes_the_same_files(model_dir, tmp_path, monkeypatch):
    from verl_npu.engine import save_staging

    engine = new_engine(model_dir, offload=True)
    train_step(engine, 0)
    seen = []
    staged_in = save_staging.staged_in

    @contextlib.contextmanager
    def recording(regions):
        with staged_in(regions) as stats:
            yield stats
        seen.append((sum(r.nbytes for r in regions), stats))

    monkeypatch.setattr(save_staging, "staged_in", recording)
    engine.save_checkpoint(str(tmp_path / "staged"), global_step=1)
    monkeypatch.setattr(type(engine), "_idle_host_regions", lambda self: [])  # megatron's own copies
    engine.save_checkpoint(str(tmp_path / "megatron"), global_step=1)
    (arena_bytes, staged), (_, unstaged) = seen
    state = engine._offload_manager
    assert arena_bytes == state.host_bytes() > 0 and unstaged.staged_tensors == 0
    # the optimizer's tensors (main parameters, moments) all fit in the arenas they are offloaded to
    assert staged.staged_bytes >= state._arena_bytes("optimizer") // 2 and staged.megatron_bytes == 0
    assert offloaded(engine)
    written = sorted((tmp_path / "megatron").rglob("*.distcp"))
    assert {f.relative_to(tmp_path / "megatron").parts[0] for f in written} == {"optimizer", "extra"}
    for saved in written:
        twin = tmp_path / "staged" / saved.relative_to(tmp_path / "megatron")
        assert twin.read_bytes() == saved.read_bytes(), saved
