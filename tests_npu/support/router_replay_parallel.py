"""One rank of a gloo run of MoE routing replay through verl's engine on the tiny GLM-5.2, CPU harness.

    python router_replay_parallel.py RANK WORLD PORT WORKDIR [--tp N] [--ep N]
    python router_replay_parallel.py RANK WORLD PORT WORKDIR --layout-only --tp N --cp N

Builds verl's engine (ours, through EngineRegistry) with tensor parallelism ``--tp`` (sequence parallel when it
is above 1) and expert parallelism ``--ep`` over WORLD ranks, runs R2 (record with micro-batch 2, routers
perturbed, replay with micro-batch 1) and then R3 (the rollout's routes of the MoE layers), and writes the counts
of tests_npu/support/router_replay_harness.py to WORKDIR/rank<R>-of-<WORLD>.pt, or the traceback to
WORKDIR/rank<R>-of-<WORLD>.error. WORKDIR/model holds the checkpoint. Uses verl_npu/testing/cpu_megatron.py.

``--layout-only`` runs no model: megatron's DSA refuses context parallelism (MindSpeed brings it on Ascend), so
under CP the conversion of verl_npu.engine.router_replay is checked against the rows the model would see. They
are verl's padded forward input (``preprocess_bshd_engine``, which gives a CP rank its zigzag chunks), embedded
as ``[seq, batch]`` and split into contiguous position blocks by sequence parallelism. Each router row carries its
token's id as its "route"; the record must return every sample's ids in order, the replay must lay them back on
this rank's rows, and only real tokens may be marked for replay.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests_npu: `support`


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port"):
        parser.add_argument(name, type=int)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--layout-only", action="store_true")
    args = parser.parse_args()
    stem = args.workdir / f"rank{args.rank}-of-{args.world}"
    try:
        torch.save(run(args), f"{stem}.pt")
    except BaseException:
        Path(f"{stem}.error").write_text(traceback.format_exc())
        raise


def run(args) -> dict:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(args.rank), WORLD_SIZE=str(args.world),
        LOCAL_RANK=str(args.rank), VERL_ENGINE_DEVICE="npu", VERL_ENGINE_VENDOR="huawei",
    )  # fmt: skip
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    from verl_npu.testing import cpu_megatron

    cpu_megatron.activate()
    if args.layout_only:
        return layout_round_trip(args)
    import verl_npu.megatron_adaptor as layer

    layer.load()
    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = "cpu"  # verl's own paths move routes to "cuda" off Ascend
    from support.router_replay_harness import r2_scenario, r3_scenario, replay_engine

    model = args.workdir / "model"
    r2 = r2_scenario(replay_engine(model, "R2", tp=args.tp, ep=args.ep), 31 + args.rank * (args.tp == 1), {
        "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2,
    })  # fmt: skip
    r3 = r3_scenario(replay_engine(model, "R3", tp=args.tp, ep=args.ep), 41, 7)
    return {"r2": r2, "r3": r3}


def layout_round_trip(args) -> dict:
    from types import SimpleNamespace

    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import preprocess_bshd_engine

    from verl_npu.engine import router_replay

    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tp, context_parallel_size=args.cp)
    tf_config = SimpleNamespace(sequence_parallel=args.tp > 1, fp8=None)
    tp_rank, layers = mpu.get_tensor_model_parallel_rank(), 3
    results = {}
    for lengths, forced in (((13, 29, 6, 21), None), ((5, 17, 11, 2), 40)):
        ids = torch.cat([1000 * k + torch.arange(1, n + 1) for k, n in enumerate(lengths)]).to(torch.int16)
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        per_sample = torch.nested.nested_tensor_from_jagged(ids, offsets=offsets)
        layout = router_replay.PaddedLayout(
            lengths=lengths, forced_max_seqlen=forced, use_fp8_padding=False, tp_size=args.tp, cp_size=args.cp,
            cp_rank=mpu.get_context_parallel_rank(),
        )  # fmt: skip
        seen, _, _ = preprocess_bshd_engine(per_sample, forced_max_seqlen=forced)  # [batch, local seq]
        rows = seen.transpose(0, 1).reshape(-1).chunk(args.tp)[tp_rank]
        # layer l's router row holds (token id, l) as its two "experts"
        routers = [
            SimpleNamespace(recorded_topk_idx=torch.stack([rows, torch.full_like(rows, layer)], dim=-1))
            for layer in range(layers)
        ]
        recorded = router_replay.record(routers, layout, tf_config, torch.device("cpu"))
        expected = torch.stack([torch.stack([ids, torch.full_like(ids, layer)], -1) for layer in range(layers)], 1)
        routes = torch.nested.nested_tensor_from_jagged(expected, offsets=offsets)
        targets, keep = router_replay.replay_targets(routes, None, layout, tf_config, torch.device("cpu"))
        results[lengths] = {
            "record_exact": recorded.offsets().tolist() == offsets.tolist()
            and torch.equal(recorded.values(), expected),
            "replay_ids_exact": torch.equal(targets[:, 0, 0][keep], rows[rows != 0].long())
            and torch.equal(targets[:, :, 1][keep], torch.arange(layers).expand(int(keep.sum()), layers)),
            "replayed_rows_are_the_real_tokens": torch.equal(keep, rows != 0),
            "rows": rows.numel(),
        }
    return results


if __name__ == "__main__":
    main()
