"""verl_npu.cluster.smoke on a real local Ray cluster whose "NPU"s are CPU slots (gloo stands in for HCCL)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    started = subprocess.run(
        [*RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--resources", json.dumps({"NPU": 2}),
         "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr[-2000:]
    yield "auto", env  # "auto" finds it through Ray's default temp dir, where its auth token lives
    subprocess.run([*RAY, "stop", "--force"], capture_output=True, env=env, timeout=120, check=False)


def smoke(ray_head, *args: str) -> subprocess.CompletedProcess[str]:
    address, env = ray_head
    return subprocess.run(
        [sys.executable, "-m", "verl_npu.cluster.smoke", "--address", address, "--backend", "gloo", *args],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )  # fmt: skip


def test_all_registered_devices_all_reduce_to_the_right_sum(ray_head):
    done = smoke(ray_head, "--expect", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gloo all-reduce over 2 ranks OK" in done.stdout
    assert "2 NPU devices on 1 nodes" in done.stdout


def test_a_missing_device_fails_with_the_count_and_the_nodes(ray_head):
    done = smoke(ray_head, "--expect", "3", "--wait-timeout", "1")
    assert done.returncode == 1
    assert "only 2 of 3 NPU devices registered" in done.stderr
    assert "1 nodes:" in done.stderr
