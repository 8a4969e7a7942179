"""Before a multi-node job trains: wait until every NPU has joined Ray, then all-reduce over all of them.

A 32-node job otherwise learns about a node that never joined, or a broken HCCL link, from a
timeout an hour into checkpoint loading. Run on the Ray head once the workers have started::

    python -m verl_npu.cluster.smoke --expect 512              # Ascend: HCCL over every NPU
    python -m verl_npu.cluster.smoke --expect 2 --backend gloo # the same check on CPU resources

Exit 0 when all ``--expect`` devices registered and the all-reduce over all of them returned the
right sum on every rank; otherwise exit 1 naming the ranks and nodes that are missing or failed.

Each rank is a Ray actor holding one device. Ray (2.60, ``ray/_private/accelerators``) narrows
what such an actor sees: ASCEND_RT_VISIBLE_DEVICES (CUDA_VISIBLE_DEVICES for GPUs) lists only the
device it assigned, so inside the actor that device is index 0, whatever Ray's id for it. The
rendezvous store is opened by rank 0 on its own node: Ray may place rank 0 on any node with a free
device, and the head, where this driver runs, often has none.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

BACKEND_RESOURCE = {"hccl": "NPU", "nccl": "GPU", "gloo": "NPU"}
VISIBLE_DEVICES_VARIABLE = {"NPU": "ASCEND_RT_VISIBLE_DEVICES", "GPU": "CUDA_VISIBLE_DEVICES"}
DEVICE_TYPE = {"NPU": "npu", "GPU": "cuda"}


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
        time.sleep(min(poll, max(timeout - waited, 0.1)))


def local_device_index(resource: str, accelerator_id: str, visible: str | None) -> int:
    """Index, inside this process, of the device Ray calls ``accelerator_id``.

    ``visible`` is the process's ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES (None: unset).
    When Ray set it, it lists exactly the assigned device, so the answer is 0. When the operator
    set it and told Ray not to (RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES), Ray's ids are
    entries of that list and the device is at the id's position. Unset: nothing renumbered the
    devices, Ray's id is the index.
    """
    variable = VISIBLE_DEVICES_VARIABLE.get(resource, f"{resource} visibility variable")
    if visible is None:
        if not re.fullmatch("[0-9]{1,9}", accelerator_id):  # ASCII: str.isdigit() passes '²', which int() refuses
            raise ValueError(
                f"Ray's {resource} id {accelerator_id!r} is not a device index and {variable} is unset; "
                f"set {variable} on the node before `ray start` so that Ray's ids name visible devices"
            )
        return int(accelerator_id)
    entries = [entry.strip() for entry in visible.split(",")]
    if accelerator_id not in entries:
        raise ValueError(
            f"Ray assigned {resource} {accelerator_id!r} but {variable}={visible!r} does not list it; "
            f"restart Ray on this node without overriding {variable} for its workers "
            f"(or list the node's devices in {variable} before `ray start`)"
        )
    return entries.index(accelerator_id)


class _Member:
    """One rank. Picks its device when Ray creates it, so a bad assignment fails before anyone waits."""

    def __init__(self, rank: int, world: int, backend: str, resource: str):
        import ray

        self.rank, self.world, self.backend, self.resource = rank, world, backend, resource
        context = ray.get_runtime_context()
        self.node = ray.util.get_node_ip_address()
        self.node_id = context.get_node_id()
        self.accelerator_ids = [str(i) for i in context.get_accelerator_ids().get(resource, [])]
        variable = VISIBLE_DEVICES_VARIABLE.get(resource)
        self.visible = os.environ.get(variable) if variable else None
        self.device_index = None
        if resource in DEVICE_TYPE:
            if len(self.accelerator_ids) != 1:
                raise RuntimeError(
                    f"rank {rank} on {self.node} holds {resource} ids {self.accelerator_ids}, expected exactly one"
                )
            self.device_index = local_device_index(resource, self.accelerator_ids[0], self.visible)
        self._store = None

    def _device(self):
        import torch

        if self.backend == "hccl":
            import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

            device = torch.device("npu", self.device_index)
            torch.npu.set_device(device)
            return device
        if self.backend == "nccl":
            device = torch.device("cuda", self.device_index)
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def describe(self) -> dict:
        kind = DEVICE_TYPE.get(self.resource)
        return {
            "rank": self.rank,
            "node": self.node,
            "node_id": self.node_id,
            "accelerator_ids": self.accelerator_ids,
            "visible_devices": self.visible,
            "device_index": self.device_index,
            "device": f"{kind}:{self.device_index}" if kind else "cpu",
        }

    def open_store(self, timeout: float) -> str:
        """Rank 0: listen for the other ranks on this node; port 0 lets the kernel pick a free one."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            self.node,
            0,
            self.world,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        return f"{self.node}:{self._store.port}"

    def all_reduce(self, store_address: str, timeout: float) -> dict:
        """Join the group through rank 0's store and all-reduce rank+1: the sum must be world*(world+1)/2."""
        import torch
        import torch.distributed as dist

        limit = datetime.timedelta(seconds=max(timeout, 1.0))
        started = time.monotonic()
        store = self._store
        if store is None:
            host, port = store_address.rsplit(":", 1)
            try:
                store = dist.TCPStore(host, int(port), self.world, is_master=False, timeout=limit)
            except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
                raise RuntimeError(
                    f"rank {self.rank} on {self.node} could not reach rank 0's store at {store_address} within "
                    f"{timeout:.0f} s ({_first_line(exc)}); let {self.node} reach that address (firewall, routing)"
                ) from None
        device = self._device()
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world, timeout=limit)
        try:
            value = torch.tensor([self.rank + 1.0], device=device)
            dist.all_reduce(value)
            total = value.item()
        finally:
            dist.destroy_process_group()
        # "device" is the NPU/GPU Ray assigned (HCCL/NCCL run on it); gloo runs the sum on the CPU
        return {
            **self.describe(),
            "tensor_device": str(device),
            "store": store_address,
            "sum": total,
            "seconds": time.monotonic() - started,
        }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _remote_error(exc: BaseException) -> str:
    """The exception a rank raised, without Ray's wrapping and traceback."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {_first_line(cause)}"
    # an actor whose __init__ raised: Ray reports it as the actor's death, the error in the traceback text
    raised = [line.strip() for line in str(exc).splitlines() if re.match(r"^\s*\w+(Error|Exception): ", line)]
    return raised[-1] if raised else _first_line(exc)


def _collect(refs: list, ranks: list[int], deadline: float, stage: str, where: dict[int, str]) -> list:
    """ray.get ``refs`` (one per rank) before ``deadline``; errors name the ranks and their nodes."""
    import ray

    remaining = max(deadline - time.monotonic(), 0.0)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=remaining)
    if pending:
        late = [rank for rank, ref in zip(ranks, refs, strict=True) if ref in pending]
        raise TimeoutError(stage.format(late=_ranks_text(late, where), done=len(ready), total=len(refs)))
    values, failures = [], []
    for rank, ref in zip(ranks, refs, strict=True):
        try:
            values.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            # a rank that died while Ray created it has no entry in ``where``; Ray's report names its node
            seen = re.search(r"\bip=([0-9A-Fa-f.:]+[0-9A-Fa-f])", str(exc))
            node = where.get(rank) or (seen.group(1) if seen else "node unknown")
            failures.append(f"rank {rank} ({node}): {_remote_error(exc)}")
    if failures:
        raise RuntimeError("; ".join(failures))
    return values


def _ranks_text(ranks: list[int], where: dict[int, str]) -> str:
    shown = [f"rank {r}" + (f" on {where[r]}" if r in where else "") for r in ranks[:8]]
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return ", ".join(shown) + more


def all_reduce_everywhere(
    world: int, backend: str, resource: str, timeout: float, runtime_env: dict | None = None
) -> list[dict]:
    """One rank per ``resource`` device; returns each rank's device, node, store address and sum.

    Every wait shares one ``timeout``: placing the ranks, opening the store, the collective.
    ``runtime_env`` goes to the rank actors (e.g. RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES).
    """
    import ray

    if backend != "gloo" and resource != BACKEND_RESOURCE[backend]:
        raise ValueError(
            f"the {backend} backend needs ranks on {BACKEND_RESOURCE[backend]} devices, got resource {resource!r}: "
            f"only for those does Ray tell a rank which device it holds; drop --resource or use gloo"
        )
    options = {"num_cpus": 0}
    if resource == "GPU":
        options["num_gpus"] = 1  # Ray refuses GPU through ``resources``
    else:
        options["resources"] = {resource: 1}
    if runtime_env:
        options["runtime_env"] = runtime_env
    member = ray.remote(_Member).options(**options)
    deadline = time.monotonic() + timeout
    members = [member.remote(rank, world, backend, resource) for rank in range(world)]
    ranks = list(range(world))
    try:
        try:
            placed = _collect([m.describe.remote() for m in members], ranks, deadline, "{late}", {})
        except TimeoutError as exc:
            free = ray.available_resources().get(resource, 0)
            why = (
                f"Ray has no free {resource} for them; check `ray status` and that no other job holds the devices"
                if free < 1
                else f"{free:g} {resource} are free, so their worker processes did not start in time; "
                "read the raylet logs of their nodes (/tmp/ray/session_latest/logs)"
            )
            raise TimeoutError(f"{exc} not placed within {timeout:.0f} s: {why}") from None
        where = {p["rank"]: p["node"] for p in placed}
        store_address = _collect(
            [members[0].open_store.remote(max(deadline - time.monotonic(), 1.0))],
            [0],
            deadline,
            f"rank 0 on {where[0]} did not open its store within {timeout:.0f} s",
            where,
        )[0]
        results = _collect(
            [m.all_reduce.remote(store_address, max(deadline - time.monotonic(), 1.0)) for m in members],
            ranks,
            deadline,
            f"the {backend} all-reduce did not finish within {timeout:.0f} s ({{done}} of {{total}} ranks "
            f"returned; still waiting: {{late}}); the store is at {store_address}: check that those nodes reach "
            f"it, and their HCCL_SOCKET_IFNAME / HCCL_IF_BASE_PORT (`python -m verl_npu.cluster.network check`)",
            where,
        )
    finally:
        for m in members:
            ray.kill(m)
    expected = world * (world + 1) / 2
    wrong = [r for r in results if r["sum"] != expected]
    if wrong:
        nodes = sorted({r["node"] for r in wrong})
        raise RuntimeError(
            f"all-reduce returned a wrong sum on {len(wrong)} ranks (nodes {', '.join(nodes)}; expected {expected}, "
            f"got {sorted({r['sum'] for r in wrong})})"
        )
    return results


def _by_node(results: list[dict]) -> str:
    nodes: dict[str, list[dict]] = {}
    for r in results:
        nodes.setdefault(r["node"], []).append(r)
    lines = []
    for node, ranks in sorted(nodes.items()):
        devices = sorted({r["device"] for r in ranks})
        lines.append(f"[smoke]   {node}: {len(ranks)} ranks on {', '.join(devices)}")
    return "\n".join(lines)


MAX_TIMEOUT_S = 86400.0  # a day: no registration or all-reduce that is still healthy takes longer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verl_npu.cluster.smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--expect", required=True, help="devices the cluster must have (nodes x per node)")
    parser.add_argument("--backend", choices=sorted(BACKEND_RESOURCE), default="hccl")
    parser.add_argument("--resource", help="Ray resource name of one device (default: NPU, GPU for nccl)")
    parser.add_argument("--address", default="auto", help="Ray cluster address")
    parser.add_argument("--wait-timeout", default="1800", help="seconds to wait for devices to register")
    parser.add_argument("--reduce-timeout", default="600", help="seconds for the all-reduce")
    parser.add_argument("--json", type=Path, help="write every rank's node, device and timing to this file")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, their numbers through verl_npu.inputs (ASCII digits, as `verl-npu k8s render` reads them: float()
    and int() would also read '١٦' and 'nan'), the backend's resource and --json's directory: a bad one is exit 2
    (argparse's usage error) before Ray is touched."""
    from verl_npu import atomic, inputs

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.expect = inputs.integer("--expect", args.expect, minimum=1, maximum=inputs.MAX_DEVICES)
        args.wait_timeout = inputs.number("--wait-timeout", args.wait_timeout, above=0, maximum=MAX_TIMEOUT_S)
        args.reduce_timeout = inputs.number("--reduce-timeout", args.reduce_timeout, above=0, maximum=MAX_TIMEOUT_S)
    except inputs.InputError as exc:
        parser.error(str(exc))
    args.resource = args.resource or BACKEND_RESOURCE[args.backend]
    if args.backend != "gloo" and args.resource != BACKEND_RESOURCE[args.backend]:
        parser.error(
            f"--backend {args.backend} runs on --resource {BACKEND_RESOURCE[args.backend]}, got {args.resource!r}"
        )
    if args.json is not None:
        why = atomic.output_problem(args.json)
        if why is not None:
            parser.error(f"--json {args.json}: {why}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    resource = args.resource
    try:
        ray.init(address=args.address, log_to_driver=False)
    except ConnectionError as exc:
        print(f"[smoke] FAILED: no Ray cluster at --address {args.address} ({_first_line(exc)})", file=sys.stderr)
        return 1
    try:
        per_node = wait_for_devices(args.expect, resource, args.wait_timeout)
        holding = sum(1 for n in per_node.values() if n)
        print(f"[smoke] {sum(per_node.values())} {resource} devices on {holding} nodes", flush=True)
        results = all_reduce_everywhere(args.expect, args.backend, resource, args.reduce_timeout)
    except (TimeoutError, RuntimeError, ValueError) as exc:
        print(f"[smoke] FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    rank0 = next(r for r in results if r["rank"] == 0)
    slowest = max(results, key=lambda r: r["seconds"])
    print(f"[smoke] store on rank 0 at {rank0['store']}", flush=True)
    print(_by_node(results), flush=True)
    print(
        f"[smoke] {args.backend} all-reduce over {len(results)} ranks OK (slowest: rank {slowest['rank']} on "
        f"{slowest['node']}, {slowest['seconds']:.1f} s)",
        flush=True,
    )
    if args.json:
        from verl_npu import atomic

        try:
            atomic.write_text(args.json, json.dumps(sorted(results, key=lambda r: r["rank"]), indent=1) + "\n")
        except (OSError, atomic.OutputPathError) as exc:  # the all-reduce passed (above); its record was not kept
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            print(f"[smoke] --json {args.json}: cannot write it ({why})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
