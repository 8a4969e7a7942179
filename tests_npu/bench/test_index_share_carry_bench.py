"""bench/index_share_carry.py (issue 33, item 1) on the CPU: two gloo ranks run megatron's 1F1B over the GLM-5.2
stages with the carry, and the measurement counts what the schedule did (one carry per micro-batch, each received
between its activation and its forward), with the bytes the carry and the activation hold. The figures themselves
need two GPUs (nvidia-h200-x2); here the bench is checked, not measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.paths import REPO

BENCH = REPO / "bench" / "index_share_carry.py"


def test_the_carry_bench_refuses_a_launch_without_two_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(BENCH), "--cpu", "--out", str(tmp_path / "r.json")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 2 and "torchrun with two ranks" in done.stderr, done.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_the_carry_bench_counts_one_carry_per_micro_batch_between_activation_and_forward(tmp_path):
    torchrun = REPO / ".venv" / "bin" / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"{torchrun} is absent: the bench runs under torchrun")
    out, micro_batches, seq = tmp_path / "carry.json", 3, 64
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(BENCH), "--cpu", "--out", str(out),
         "--seqs", str(seq), "--micro-batches", str(micro_batches), "--repeats", "1"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "gloo" and report["stages"] == [
        ["full", "shared", "shared"],
        ["shared", "full", "shared"],
    ]
    (row,) = report["rows"]
    shape = report["shape"]
    assert row["alone"]["carry_bytes"] == seq * shape["index_topk"] * 4 + 24  # int32 [1, s, k] and the header
    assert row["alone"]["activation_bytes"] == seq * shape["hidden_size"] * 4  # float32 [s, 1, h]
    summary = row["summary"]
    assert summary["micro_batches_carried"] == summary["carry_sends"] == summary["receiver_forwards"] == micro_batches
    receiver = [e["kind"] for e in row["events"]["stage1"]]
    for i in range(micro_batches):  # activation, then its carry, then the forward that reads it
        start = [k for k in receiver if k != "p2p: send grad"]
        assert "recv activation" in start[3 * i] and start[3 * i + 1 : 3 * i + 3] == ["carry: recv", "forward"], start
    assert all(e["device_ms"] >= 0 for e in row["events"]["stage0"] if "device_ms" in e)
    assert 0 < summary["carry_per_step_over_step"] < 1
