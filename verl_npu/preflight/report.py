"""Preflight's result: the report (checks, model, memory estimate), as a rich table, JSON and a plot."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_npu import checks as shared_checks
from verl_npu.checks import Check

if TYPE_CHECKING:  # rich loads when a report is printed, not when preflight starts
    from rich.console import Console
    from rich.table import Table


@dataclasses.dataclass
class PreflightReport:
    source: str
    chip: str
    checks: list[Check]
    overrides: list[str]
    model: dict[str, Any] | None = None
    memory: Any = None  # verl_npu.preflight.memory.MemoryEstimate
    rollout: Any = None  # verl_npu.preflight.rollout.RolloutEstimate
    model_origin: str | None = None  # FROM_MODEL_CONFIG, FROM_MODEL_PATH, FROM_BESIDE_SCRIPT or FROM_NAME
    startup: Any = None  # verl_npu.preflight.startup.StartupEstimate

    @property
    def verdict(self) -> str:
        """ "go" unless a check failed."""
        return "no-go" if shared_checks.failed(self.checks) else "go"

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "chip": self.chip,
            "verdict": self.verdict,
            "checks": shared_checks.to_json(self.checks),
            "overrides": self.overrides,
            "model": self.model,
            "model_origin": self.model_origin,
            "memory": self.memory.to_dict() if self.memory is not None else None,
            "rollout": self.rollout.to_dict() if self.rollout is not None else None,
            "startup": self.startup.to_dict() if self.startup is not None else None,
        }


COMPONENTS = ("weights", "grads", "optimizer", "activations", "carry", "workspace", "overhead")


def checks_table(report: PreflightReport) -> Table:
    title = f"verl-npu preflight: {report.source} (chip {report.chip})"
    return shared_checks.table(report.checks, title, escape=True)  # details hold text such as "[b, s, k]"


def memory_table(report: PreflightReport) -> Table | None:
    from rich.table import Table

    from verl_npu.preflight.memory import GiB

    memory = report.memory
    if memory is None:
        return None
    gib = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    table = Table(title=f"HBM per device (GiB of {gib(memory.capacity_bytes)}) by pipeline stage")
    share = any(stage.index_share is not None for stage in memory.stages)
    columns = ("stage", "layers", *(("full / shared",) if share else ()), *COMPONENTS)
    for column in (*columns, "train peak", "rollout phase", "host / device"):
        table.add_column(column, justify="right", overflow="fold")
    for stage in memory.stages:
        rollout = memory.rollout_bytes(stage) if memory.rollout_reserved_bytes else None
        room = memory.headroom(stage)
        peak = (
            gib(stage.train_bytes) if room["train"] is None or room["train"] >= 0 else f"[red]{gib(stage.train_bytes)}"
        )
        roll = "-" if rollout is None else (gib(rollout) if room["rollout"] >= 0 else f"[red]{gib(rollout)}")
        table.add_row(
            str(stage.stage),
            str(stage.layers),
            *((_indexers(stage.index_share),) if share else ()),
            *(gib(stage.train.get(c, 0)) for c in COMPONENTS),
            peak,
            roll,
            gib(stage.host_bytes),
        )
    host = f"host RAM: {gib(memory.node_host_bytes)} GiB on the busiest node (node {memory.worst_node}"
    host += f", stages {list(memory.worst_node_stages)}: {gib(memory.host_bytes_per_node)} offloaded actor state + "
    host += f"{gib(memory.rollout_host_bytes_per_node)} rollout sleep-mode copies"
    host += f" + {gib(memory.routes_host_bytes_per_node)} replay routes)" if memory.replay_routes is not None else ")"
    if memory.host_capacity_bytes:
        host += f" of {gib(memory.host_capacity_bytes)} GiB"
    table.caption = host + f"; rollout phase = offload floor + vLLM's {gib(memory.rollout_reserved_bytes)} GiB"
    if share:
        table.caption += "; " + _carry_caption(memory.stages)
    return table


def _indexers(layout) -> str:
    """DSA layers with their own indexer / sharing one; "<" marks a stage that receives the top-k carry."""
    if layout is None:
        return "-"
    return ("< " if layout.receives else "") + f"{len(layout.full_layers)}/{len(layout.shared_layers)}"


def _carry_caption(stages) -> str:
    """What the IndexShare columns mean, and the carry's traffic per micro-batch at each stage boundary."""
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    text = "IndexShare: full/shared DSA layers (< = receives the top-k carry); carry = top-k kept for backward"
    sends = [
        (s.stage, s.index_share.send_bytes_per_microbatch) for s in stages if s.index_share and s.index_share.sends
    ]
    if not sends:
        return text + "; no stage sends a top-k"
    if len({size for _, size in sends}) == 1:
        boundaries = ", ".join(f"{stage}->{stage + 1}" for stage, _ in sends)
        return text + f"; top-k sent per micro-batch: {mib(sends[0][1])} at {boundaries}"
    return text + "; top-k sent per micro-batch: " + ", ".join(f"{st}->{st + 1} {mib(n)}" for st, n in sends)


def startup_table(report: PreflightReport) -> Table | None:
    """The start-up estimate: what the busiest node reads, at what rate, and the HCCL timeouts it needs."""
    from rich.table import Table

    from verl_npu.preflight import startup as s

    e = report.startup
    if e is None:
        return None
    table = Table(title="Start-up: the HF checkpoint load (docs/preflight_startup.md)")
    table.add_column("quantity", overflow="fold")
    table.add_column("value", overflow="fold")
    rows = [
        ("checkpoint", f"{e.checkpoint_bytes / s.GB:,.1f} GB, {e.storage} ({e.checkpoint_source})"),
        ("nodes", f"{e.nodes} x {e.ranks_per_node} ranks"),
        ("each node reads", e.reads),
        (
            "busiest node",
            f"node {e.busiest.node} (stages {list(e.busiest.stages)}): {e.shard_bytes / s.GB:,.1f} GB",
        ),
        ("disk rate", "unknown" if e.read_gbps is None else f"{e.read_gbps:g} GB/s ({e.rate_source})"),
        ("engine's share of it", f"{s.ENGINE_SHARE_OF_DISK_RATE} (measured on the nvidia-h200)"),
    ]
    if e.read_gbps is not None:
        rows += [
            ("load per node", f"{e.load_seconds():,.0f} s"),
            (
                "minimum HCCL timeouts",
                f"{e.minimum_timeout()} s = {s.SAFETY_FACTOR:g} x load + {s.BUILD_ALLOWANCE_S} s build allowance",
            ),
        ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def print_report(report: PreflightReport, console: Console) -> None:
    console.print(checks_table(report))
    for table in (memory_table(report), startup_table(report)):
        if table is not None:
            console.print(table)
    if report.verdict == "go":
        console.print("[bold green]GO[/]: the launch is valid and fits")
    else:
        console.print(f"[bold red]NO-GO[/]: {shared_checks.summary(report.checks)}")


# what matplotlib's Agg canvas writes, by file suffix (savefig's format)
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def output_path(option: str, value: str, *, plot: bool = False) -> Path:
    """A file preflight will write (``--json``, ``--plot``), checked before any work: a regular file or a new one
    (verl_npu.atomic.output_problem) in a writable directory, and a plot's suffix names a format. Raises InputError
    naming the option."""
    from verl_npu.atomic import output_problem
    from verl_npu.bounded_read import NotReadable, expand_user
    from verl_npu.inputs import InputError

    try:
        path = expand_user(value)
    except NotReadable as exc:
        raise InputError(option, value, f"a path ({exc})") from None
    why = output_problem(path)
    if why is not None:
        raise InputError(option, value, f"a regular file, or a new one, in a writable directory ({path}: {why})")
    if plot and path.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise InputError(option, value, f"a file name ending in one of .{', .'.join(PLOT_FORMATS)}")
    return path


def write_json(report: PreflightReport, path: Path) -> None:
    """The report as JSON, written whole or not at all (verl_npu.atomic)."""
    from verl_npu import atomic

    atomic.write_text(path, json.dumps(report.to_dict(), indent=2, default=str) + "\n")


def plot(report: PreflightReport, path: Path) -> None:
    """A stacked bar per pipeline stage: the memory components and what is free, against capacity."""
    if report.memory is None:
        raise ValueError("no memory estimate to plot (an earlier check failed); see the report")
    import io

    import matplotlib

    from verl_npu import atomic
    from verl_npu.preflight.memory import GiB

    matplotlib.use("Agg")  # files only: preflight runs on headless machines
    import matplotlib.pyplot as plt

    memory = report.memory
    stages = [s.stage for s in memory.stages]
    capacity = memory.capacity_bytes / GiB
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(stages) + 3), 4.5))
    bottom = [0.0] * len(stages)
    for component in COMPONENTS:
        values = [s.train.get(component, 0) / GiB for s in memory.stages]
        ax.bar(stages, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    free = [max(capacity - b, 0.0) for b in bottom]
    ax.bar(stages, free, bottom=bottom, label="free", color="#dddddd")
    ax.axhline(capacity, color="red", linestyle="--", linewidth=1, label=f"capacity {capacity:.0f} GiB")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per device (training step)")
    ax.set_title(f"{Path(report.source).name}: HBM per stage ({report.verdict})")
    ax.set_xticks(stages)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=120, format=path.suffix.lower().lstrip(".") or "png")
    plt.close(fig)
    atomic.write_bytes(path, image.getvalue())  # whole or not at all
