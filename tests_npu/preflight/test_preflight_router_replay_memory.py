"""Routing replay's routes in preflight's host RAM estimate (verl_npu.preflight.memory.ReplayRoutes,
verl_npu.preflight.memory_plan.replay_routes), on the GLM-5.2 example launch with the replay overrides.

The example (examples/glm5_2/run_glm5_2_grpo_a3.sh): 32 nodes x 16 NPUs, train TP 2 x PP 8 x CP 4 (DP 8), 64
prompts x n = 8 = 512 samples a step of up to 24k + 8k = 32,768 tokens, mini-batches of 32 prompts; GLM-5.2 has 78
decoder layers, 75 of them MoE, top-8. The expected bytes below are written out from those numbers, not taken from
the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest
from support.paths import REPO

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.preflight import run_preflight
from verl_npu.preflight.memory import GiB, ReplayRoutes

LAUNCH = REPO / "examples" / "glm5_2" / "run_glm5_2_grpo_a3.sh"
MODE = "actor_rollout_ref.actor.megatron.router_replay.mode"
ROUTES = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
R3 = (f"{MODE}=R3", f"{ROUTES}=True")
HOST_GIB = 1500

TOKENS, SAMPLES, NODES, DEVICES, DP = 32_768, 64 * 8, 32, 16, 8
SHARE, MINI = SAMPLES // DP, 32 * 8 // DP  # per training process: its DP share, one update mini-batch
R3_TOKEN = 78 * 8 * 2  # int16 over every decoder layer, top-8
R2_TOKEN = 75 * 8 * 2  # int16 over the MoE layers the old-log-prob pass records


def expected_node_bytes(bytes_per_token: int) -> int:
    sample = TOKENS * bytes_per_token
    storage = SAMPLES // 8 * sample  # 8 TransferQueue units over 32 nodes: one unit (1/8 of the step) on the busiest
    processes = DEVICES * (SHARE + max(SHARE, 2 * MINI)) * sample  # share + its micro-batch copies, 16 per node
    return storage + processes


def routes_check(report):
    return [c for c in report.checks if c.check == "memory.replay-routes"]


@pytest.fixture(scope="module")
def without_replay():
    return run_preflight(LAUNCH, host_memory_gib=HOST_GIB)


@pytest.fixture(scope="module")
def with_r3():
    return run_preflight(LAUNCH, R3, host_memory_gib=HOST_GIB)


def test_without_replay_the_estimate_is_unchanged(without_replay):
    memory = without_replay.memory
    assert memory.replay_routes is None and memory.routes_host_bytes_per_node == 0
    assert memory.node_host_bytes == memory.host_bytes_per_node + memory.rollout_host_bytes_per_node
    assert memory.to_dict()["replay_routes"] is None and memory.to_dict()["routes_host_bytes_per_node"] == 0
    assert routes_check(without_replay) == []
    (fits,) = [c for c in without_replay.checks if c.check == "memory.fits"]
    assert "routing replay" not in fits.detail


def test_r3_adds_the_routes_kept_with_the_step_to_the_busiest_node(with_r3, without_replay):
    memory, before = with_r3.memory, without_replay.memory
    added = expected_node_bytes(R3_TOKEN)
    assert R3_TOKEN == 1_248 and added == 86_369_107_968  # 2.4 GiB of storage + 16 x 4.9 GiB of processes
    assert memory.routes_host_bytes_per_node == added
    assert memory.node_host_bytes - before.node_host_bytes == added
    assert (memory.host_bytes_per_node, memory.rollout_host_bytes_per_node) == (
        before.host_bytes_per_node,
        before.rollout_host_bytes_per_node,
    )
    routes = memory.to_dict()["replay_routes"]
    assert (routes["mode"], routes["recorded"], routes["layers"], routes["top_k"]) == ("R3", False, 78, 8)
    assert routes["batch_bytes"] == SAMPLES * TOKENS * R3_TOKEN  # 19.5 GiB for the step


def test_r3_numbers_are_in_the_report(with_r3):
    (check,) = routes_check(with_r3)
    assert check.status == OK
    for shown in ("int16 [tokens, 78, top-8]", "1,248 B per token", "512 samples: 19.5 GiB", "8 storage units over "
                  "32 nodes", "64 samples, DP 8", "128 samples' routes at once: 4.9 GiB x 16 processes per node = "
                  "78.0 GiB", "Up to 80.4 GiB on the busiest node"):  # fmt: skip
        assert shown in check.detail, shown
    (fits,) = [c for c in with_r3.checks if c.check == "memory.fits"]
    assert "80.4 GiB of routing replay routes" in fits.detail
    assert with_r3.verdict == "go"


def test_the_routes_can_make_a_node_too_small(with_r3, without_replay):
    """A node of 850 GiB holds the example without replay (801.8 GiB) and not with R3's routes (882.3 GiB)."""
    from verl_npu.preflight.memory import Offload
    from verl_npu.preflight.memory_plan import memory_checks

    offload = Offload(param_offload=True, optimizer_offload=True)
    capacity = 850 * GiB
    plain = memory_checks(dataclasses.replace(without_replay.memory, host_capacity_bytes=capacity), offload, "a3")
    assert [c.check for c in plain] == ["memory.fits"]
    (host,) = memory_checks(dataclasses.replace(with_r3.memory, host_capacity_bytes=capacity), offload, "a3")
    assert host.check == "memory.host" and host.status == FAIL
    assert "needs 882.3 GiB of host RAM" in host.detail and "80.4 GiB of routing replay routes" in host.detail


def test_r2_counts_the_routes_the_old_log_prob_pass_records(without_replay):
    report = run_preflight(LAUNCH, (f"{MODE}=R2",), host_memory_gib=HOST_GIB)
    memory = report.memory
    assert memory.routes_host_bytes_per_node == expected_node_bytes(R2_TOKEN) == 83_047_219_200
    assert memory.node_host_bytes - without_replay.memory.node_host_bytes == expected_node_bytes(R2_TOKEN)
    (check,) = routes_check(report)
    assert check.status == OK and "R2: the old-log-prob pass records the routes of the 75 MoE layers" in check.detail
    assert "1,200 B per token" in check.detail


def test_routes_the_rollout_returns_are_counted_with_replay_off(without_replay):
    """The rollout's routes reach the batch whatever the mode (router-replay.rollout-routes warns about it)."""
    report = run_preflight(LAUNCH, (f"{ROUTES}=True",), host_memory_gib=HOST_GIB)
    assert report.memory.routes_host_bytes_per_node == expected_node_bytes(R3_TOKEN)
    assert "(the replay mode is disabled)" in routes_check(report)[0].detail


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.use_v1=False", "with trainer.use_v1=False verl's legacy trainer holds the batch in its driver"),
        ("transfer_queue.backend.storage_backend=MooncakeStore",
         "transfer_queue.backend.storage_backend=MooncakeStore: preflight models TransferQueue's SimpleStorage only"),
    ],
)  # fmt: skip
def test_a_batch_store_preflight_does_not_model_is_a_warning_and_counts_nothing(override, named, without_replay):
    report = run_preflight(LAUNCH, (*R3, override), host_memory_gib=HOST_GIB)
    (check,) = routes_check(report)
    assert check.status == WARN and named in check.detail and "19.5 GiB for the step's 512 samples" in check.detail
    assert report.memory.replay_routes is None
    assert report.memory.node_host_bytes == without_replay.memory.node_host_bytes


def test_where_the_routes_sit_per_node_and_per_process():
    """ReplayRoutes' layout rules on small numbers: storage units round-robin over the nodes, a process's share and
    its copies, and the driver's two copies when the load-balance metrics fetch the step."""
    routes = ReplayRoutes(mode="R3", recorded=False, layers=4, top_k=2, samples=10, tokens_per_sample=3,
                          data_parallel=2, mini_batch_samples=4, storage_units=4, nodes=3,
                          devices_per_node=2)  # fmt: skip
    assert routes.sample_bytes == 3 * 4 * 2 * 2 == 48
    assert routes.storage_samples_per_node == 2 * 3  # 4 units over 3 nodes: 2 on one; 10 samples: 3 a unit
    assert routes.samples_per_process == 5 and routes.mini_batch_samples_per_process == 2
    assert routes.process_samples == 5 + 5  # the share split into micro-batches outweighs two mini-batches of 2
    assert routes.bytes_per_node == 6 * 48 + 2 * 10 * 48
    one_node = dataclasses.replace(routes, nodes=1, storage_units=8)
    assert one_node.storage_samples_per_node == 10  # every unit on the one node, never more than the step
    driver = dataclasses.replace(routes, data_parallel=10, driver_fetches=True)  # a share of 1, mini-batches of 1
    assert driver.process_samples == 1 + 2  # now two mini-batches outweigh the share's micro-batches
    assert driver.process_bytes_per_node == 2 * 3 * 48 and driver.driver_bytes == 2 * 10 * 48
    assert driver.bytes_per_node == driver.storage_bytes_per_node + 2 * 10 * 48


def test_verl_copies_what_it_splits_into_mini_and_micro_batches():
    """verl 0.9.1's engine splits a process's data into micro-batches, and the update first into mini-batches, each
    a copy of the routes it takes (what ReplayRoutes.process_samples counts), executed on a nested routes field as
    the v1 trainer hands it over; and the bytes per sample are tokens x layers x top-k x 2."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    lengths, layers, top_k = (5, 9, 3, 7), 4, 2
    routes = torch.nested.as_nested_tensor(
        [torch.full((n, layers, top_k), i, dtype=torch.int16) for i, n in enumerate(lengths)], layout=torch.jagged
    )
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)
    share = TensorDict({"input_ids": ids, "routed_experts": routes}, batch_size=[len(lengths)])
    tu.assign_non_tensor(share, use_dynamic_bsz=True, max_token_len_per_gpu=10)
    shared_storage = routes.values().untyped_storage().data_ptr()
    micro_batches, _ = prepare_micro_batches(share)
    assert len(micro_batches) > 1
    copied = sum(m["routed_experts"].values().nbytes for m in micro_batches)
    assert copied == routes.values().nbytes == sum(lengths) * layers * top_k * 2
    assert all(m["routed_experts"].values().untyped_storage().data_ptr() != shared_storage for m in micro_batches)
    mini = tu.index_select_tensor_dict(share, torch.tensor([0, 2]))
    assert mini["routed_experts"].values().untyped_storage().data_ptr() != shared_storage
