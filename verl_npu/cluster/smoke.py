"""Before a multi-node job trains: wait until every NPU has joined Ray, then all-reduce over all of them.

A 32-node job otherwise learns about a node that never joined, or a broken HCCL link, from a
timeout an hour into checkpoint loading. Run on the Ray head once the workers have started::

    python -m verl_npu.cluster.smoke --expect 512              # Ascend: HCCL over every NPU
    python -m verl_npu.cluster.smoke --expect 2 --backend gloo # the same check on CPU resources

Exit 0 when all ``--expect`` devices registered and the all-reduce over all of them returned the
right sum on every rank; otherwise exit 1 naming the nodes that are missing or failed.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections import Counter

BACKEND_RESOURCE = {"hccl": "NPU", "nccl": "GPU", "gloo": "NPU"}


def registered(resource: str) -> tuple[int, Counter]:
    """(devices of ``resource`` in the cluster, devices per node IP)."""
    import ray

    per_node = Counter()
    for node in ray.nodes():
        if node.get("Alive"):
            per_node[node["NodeManagerAddress"]] += int(node["Resources"].get(resource, 0))
    return sum(per_node.values()), per_node


def wait_for_devices(expect: int, resource: str, timeout: float, poll: float = 5.0) -> Counter:
    started = time.monotonic()
    while True:
        total, per_node = registered(resource)
        if total >= expect:
            return per_node
        waited = time.monotonic() - started
        if waited > timeout:
            nodes = ", ".join(f"{ip}: {n}" for ip, n in sorted(per_node.items())) or "none"
            raise TimeoutError(
                f"only {total} of {expect} {resource} devices registered with Ray after {waited:.0f} s "
                f"({len(per_node)} nodes: {nodes}); start `ray start --address=...` on the missing nodes, "
                f"and check that their NPUs are visible (npu-smi info, ASCEND_RT_VISIBLE_DEVICES)"
            )
        print(f"[smoke] {total}/{expect} {resource} devices registered; waiting", flush=True)
        time.sleep(poll)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _member(rank: int, world: int, address: str, backend: str) -> dict:
    """One rank: join the process group and all-reduce rank+1; the sum must be world*(world+1)/2."""
    import ray
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

        device = torch.device("npu", int(ray.get_runtime_context().get_accelerator_ids()["NPU"][0]))
        torch.npu.set_device(device)
    elif backend == "nccl":
        device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        torch.cuda.set_device(device)
    started = time.monotonic()
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world)
    value = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "node": ray.util.get_node_ip_address(),
        "sum": value.item(),
        "seconds": time.monotonic() - started,
    }


def all_reduce_everywhere(world: int, backend: str, resource: str, timeout: float) -> list[dict]:
    import ray

    member = ray.remote(_member).options(num_cpus=0, resources={resource: 1})
    address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
    futures = [member.remote(rank, world, address, backend) for rank in range(world)]
    ready, pending = ray.wait(futures, num_returns=world, timeout=timeout)
    if pending:
        raise TimeoutError(
            f"the {backend} all-reduce over {world} devices did not finish in {timeout:.0f} s "
            f"({len(ready)} ranks returned); a node's network or HCCL setup is broken (check HCCL_SOCKET_IFNAME, "
            "HCCL_IF_BASE_PORT and that every node reaches the head)"
        )
    results = ray.get(ready)
    expected = world * (world + 1) / 2
    wrong = [r for r in results if r["sum"] != expected]
    if wrong:
        nodes = sorted({r["node"] for r in wrong})
        raise RuntimeError(f"all-reduce returned a wrong sum on {len(wrong)} ranks (nodes {', '.join(nodes)})")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_npu.cluster.smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--expect", type=int, required=True, help="devices the cluster must have (nodes x per node)")
    parser.add_argument("--backend", choices=sorted(BACKEND_RESOURCE), default="hccl")
    parser.add_argument("--resource", help="Ray resource name of one device (default: NPU, GPU for nccl)")
    parser.add_argument("--address", default="auto", help="Ray cluster address")
    parser.add_argument("--wait-timeout", type=float, default=1800.0, help="seconds to wait for devices to register")
    parser.add_argument("--reduce-timeout", type=float, default=600.0, help="seconds for the all-reduce")
    args = parser.parse_args(argv)
    import ray

    resource = args.resource or BACKEND_RESOURCE[args.backend]
    ray.init(address=args.address, log_to_driver=False)
    try:
        per_node = wait_for_devices(args.expect, resource, args.wait_timeout)
        print(f"[smoke] {sum(per_node.values())} {resource} devices on {len(per_node)} nodes", flush=True)
        results = all_reduce_everywhere(args.expect, args.backend, resource, args.reduce_timeout)
    except (TimeoutError, RuntimeError) as exc:
        print(f"[smoke] FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    slowest = max(results, key=lambda r: r["seconds"])
    print(
        f"[smoke] {args.backend} all-reduce over {len(results)} ranks OK (slowest: rank {slowest['rank']} on "
        f"{slowest['node']}, {slowest['seconds']:.1f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
