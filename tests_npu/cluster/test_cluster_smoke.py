"""verl_npu.cluster.smoke on a real local Ray cluster whose "NPU"s are CPU slots (gloo stands in for HCCL).

The cluster is shaped like a Kubernetes deployment: a head with no NPU (the driver runs there) and
two workers with NPUs, on their own node IPs (127.0.0.2 / 127.0.0.3: loopback addresses, so one
machine hosts them all). The NPU resource is declared as Ray's accelerator manager expects it
(``resources={"NPU": n}``), so Ray sets ASCEND_RT_VISIBLE_DEVICES for every task holding one, as it
does on an Ascend node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from verl_npu.cluster import smoke  # noqa: E402

WORKER_A, WORKER_B = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # "NPU": 0 on the head: the head pod of a real deployment often has none, and Ray must not place ranks there
    local = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"NPU": 0}, "include_dashboard": False}
    )
    local.add_node(num_cpus=1, resources={"NPU": 2}, node_ip_address=WORKER_A)
    local.add_node(num_cpus=1, resources={"NPU": 1}, node_ip_address=WORKER_B)
    ray.init(address=local.address, log_to_driver=False)
    try:
        yield local
    finally:
        ray.shutdown()
        local.shutdown()
        if saved is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = saved


def smoke_cli(cluster, tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "verl_npu.cluster.smoke", "--address", cluster.address, "--backend", "gloo", *args],
        capture_output=True, text=True, env=env, timeout=240, check=False, cwd=tmp_path,
    )  # fmt: skip


def test_each_rank_uses_the_first_device_ray_left_visible_and_the_store_lives_on_rank_0s_node(cluster):
    results = smoke.all_reduce_everywhere(3, "gloo", "NPU", 180.0)
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1, 2]
    assert all(r["sum"] == 6.0 for r in results)
    for r in results:
        # Ray narrowed each rank's view to the one NPU it assigned, so that NPU is index 0 of the process
        assert r.get("visible_devices") == r["accelerator_ids"][0], r
        assert r["device_index"] == 0 and r["device"] == "npu:0", r
    # worker A holds NPUs 0 and 1: the rank given NPU 1 would have asked for npu:1, which it cannot see
    assert sorted(r["accelerator_ids"][0] for r in results if r["node"] == WORKER_A) == ["0", "1"]

    driver_ip = ray.util.get_node_ip_address()
    store = by_rank[0].get("store")
    assert store is not None and store.rsplit(":", 1)[0] == by_rank[0]["node"] != driver_ip
    assert {r["store"] for r in results} == {store}
    assert by_rank[0]["node"] in {WORKER_A, WORKER_B}


def test_a_rank_ray_cannot_place_fails_within_the_timeout_naming_it(cluster):
    started = time.monotonic()
    # 4 ranks, 3 NPUs: which rank waits is Ray's choice
    with pytest.raises(TimeoutError, match=r"^rank \d(, rank \d)* not placed within 15 s: Ray has no free NPU"):
        smoke.all_reduce_everywhere(4, "gloo", "NPU", 15.0)
    assert time.monotonic() - started < 45


def test_the_cli_reports_the_store_and_the_devices_and_writes_every_rank(cluster, tmp_path):
    done = smoke_cli(cluster, tmp_path, "--expect", "3", "--json", "ranks.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 NPU devices on 2 nodes" in done.stdout
    assert "gloo all-reduce over 3 ranks OK" in done.stdout
    assert "store on rank 0 at 127.0.0." in done.stdout
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2]
    assert {r["device"] for r in ranks} == {"npu:0"}


def test_a_missing_device_fails_with_the_count_and_every_nodes_devices(cluster, tmp_path):
    done = smoke_cli(cluster, tmp_path, "--expect", "4", "--wait-timeout", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "only 3 of 4 NPU devices registered" in done.stderr
    assert f"{WORKER_A}: 2" in done.stderr and f"{WORKER_B}: 1" in done.stderr


@pytest.mark.parametrize(
    ("accelerator_id", "visible", "expected"),
    [
        ("3", "3", 0),  # Ray set the variable to the one NPU it assigned
        ("2", "0,1,2,3", 2),  # RAY_EXPERIMENTAL_NOSET_...: the operator's list, Ray's ids are entries of it
        ("5", None, 5),  # nothing narrowed the view: Ray's id is the device index
    ],
)
def test_the_device_index_is_the_position_of_rays_id_in_the_visible_list(accelerator_id, visible, expected):
    assert smoke.local_device_index("NPU", accelerator_id, visible) == expected


@pytest.mark.parametrize(("accelerator_id", "visible"), [("2", "4,5"), ("0", ""), ("x", None)])
def test_an_id_the_process_cannot_see_is_refused_naming_the_variable(accelerator_id, visible):
    with pytest.raises(ValueError, match=r"ASCEND_RT_VISIBLE_DEVICES|not a device index") as raised:
        smoke.local_device_index("NPU", accelerator_id, visible)
    assert repr(accelerator_id) in str(raised.value) or accelerator_id in str(raised.value)


NOSET = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"


def test_when_ray_is_told_not_to_narrow_the_view_ray_s_id_is_the_device_index(cluster):
    results = smoke.all_reduce_everywhere(3, "gloo", "NPU", 180.0, runtime_env={"env_vars": {NOSET: "1"}})
    assert all(r["sum"] == 6.0 and r["visible_devices"] is None for r in results)
    assert {r["device"] for r in results if r["node"] == WORKER_A} == {"npu:0", "npu:1"}
    assert all(r["device_index"] == int(r["accelerator_ids"][0]) for r in results)


def test_with_the_operators_list_and_ray_told_not_to_narrow_it_the_index_is_the_position_in_the_list(cluster):
    # Ray then maps its instance numbers through the list: the ranks on worker A get ids "6" and "7"
    env = {"env_vars": {NOSET: "1", "ASCEND_RT_VISIBLE_DEVICES": "6,7"}}
    results = smoke.all_reduce_everywhere(3, "gloo", "NPU", 180.0, runtime_env=env)
    on_a = {r["accelerator_ids"][0]: r["device"] for r in results if r["node"] == WORKER_A}
    assert on_a == {"6": "npu:0", "7": "npu:1"}
    assert all(r["visible_devices"] == "6,7" and r["sum"] == 6.0 for r in results)
