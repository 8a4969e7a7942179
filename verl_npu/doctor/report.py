"""``verl-npu doctor --report [FILE]``: one Markdown page about this node, to paste into an issue.

It holds what a maintainer asks for first (vllm-ascend asks for its ``collect_env`` output the same
way): versions against the manifest and the build manifest, CANN / driver / firmware, the NPUs and
their health, the torch / torch_npu / triton pairing, the runtime patches in a fresh ``import verl``
process and in a Ray worker, the HCCL_*, ASCEND_*, VERL_* and RAY_* variables, and doctor's findings.
Secrets are redacted by a variable's name and, over the whole page, by their shape
(:mod:`verl_npu.doctor.redaction`). Whatever it cannot read is listed with the reason, so a short report
on a dev box or in an image without NPUs still says why each part is missing.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import platform as _platform
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_npu import __version__, checks, doctor
from verl_npu.doctor.redaction import REDACTED, redact, redact_text  # noqa: F401  (REDACTED: re-exported)
from verl_npu.stack import Stack, build_manifest
from verl_npu.stack.detect import CommandFailed, npus_phrase, read_npu_smi

ENV_PREFIXES = ("HCCL_", "ASCEND_", "VERL_", "RAY_")
NPU_SMI_VERSION = re.compile(r"npu-smi\s+\S+\s+Version:\s*(\S+)")


def _cell(value: Any) -> str:
    text = str(value) if value is not None else ""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.unread: list[tuple[str, str]] = []

    def section(self, title: str) -> None:
        self.lines += ["", f"## {title}", ""]

    def add(self, *lines: str) -> None:
        self.lines += lines

    def not_read(self, what: str, why: str) -> None:
        self.unread.append((what, why))
        self.lines.append(f"_Not read: {what}: {why}._")


def _versions(w: _Writer, probe: doctor.Probe, stack: Stack, target: str) -> None:
    w.section("Versions")
    built = None
    if probe.build_manifest_path is None:
        w.not_read("build manifest", "none found ($VERL_NPU_BUILD_MANIFEST, the venv, /opt/verl-npu); install.sh "
                   "writes it as its last step")  # fmt: skip
    else:
        try:
            built = build_manifest.read(probe.build_manifest_path)
        except build_manifest.BuildManifestError as exc:
            w.not_read(f"build manifest {probe.build_manifest_path}", str(exc))
    if built is not None:
        w.add(
            f"Build manifest `{probe.build_manifest_path}`: target {built.get('target')}, built "
            f"{built.get('built_at', '?')}, arch {built.get('arch', '?')}, stack manifest sha256 "
            f"{str(built.get('stack_manifest_sha256', '?'))[:12]} (this checkout: {stack_sha(stack)[:12]})",
            "",
        )
    recorded = (built or {}).get("versions", {})
    rows = []
    for dist, expected in sorted(stack.expected_versions(target).items()):
        installed = ", ".join(sorted({v for v, _ in probe.distributions.get(doctor._canonical(dist), [])}))
        in_build = (recorded.get(dist) or {}).get("installed") if built else None
        same = build_manifest.same_version(installed or None, expected) if installed and "," not in installed else False
        rows.append((dist, expected, installed or "not installed", in_build or "-", "yes" if same else "NO"))
    w.add(*_table(("component", "manifest", "installed", "build manifest", "as pinned"), rows))
    if built and built.get("git"):
        w.add("")
        git_rows = [(name, g.get("ref"), g.get("resolved_commit")) for name, g in sorted(built["git"].items())]
        w.add(*_table(("git component", "ref", "commit"), git_rows))


def stack_sha(stack: Stack) -> str:
    return hashlib.sha256(stack.path.read_bytes()).hexdigest()


def _ascend_versions(w: _Writer, probe: doctor.Probe) -> str | CommandFailed | None:
    w.section("CANN, driver and firmware")
    home = probe.env.get("ASCEND_TOOLKIT_HOME") or probe.env.get("ASCEND_HOME_PATH")
    rows = []
    cann = None
    if home:
        for candidate in (Path(home) / "version.cfg", Path(home) / "compiler" / "version.info"):
            cann = doctor._read_version_file(candidate)
            if cann:
                rows.append(("CANN toolkit", cann, str(candidate)))
                break
        else:
            w.not_read("CANN version", f"no version.cfg or compiler/version.info under {home}")
    else:
        w.not_read("CANN version", "ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH not set (CANN's set_env.sh not sourced)")
    for item, rel in (("NPU driver", "driver/version.info"), ("NPU firmware", "firmware/version.info")):
        path = probe.ascend_root / rel
        version = doctor._read_version_file(path)
        if version:
            rows.append((item, version, str(path)))
        else:
            w.not_read(f"{item} version", f"{path} is missing or has no Version= line")
    npu_smi = probe.run(["npu-smi", "info"])
    if isinstance(npu_smi, str):
        match = NPU_SMI_VERSION.search(npu_smi)
        if match:
            rows.append(("npu-smi", match.group(1), "`npu-smi info`"))
    if rows:
        w.add("", *_table(("item", "version", "read from"), rows))
    return npu_smi


def _npus(w: _Writer, probe: doctor.Probe, plat: doctor.Platform, npu_smi: str | CommandFailed | None) -> None:
    w.section("NPUs")
    if isinstance(npu_smi, CommandFailed):
        w.not_read("NPU count and health", npu_smi.describe())
        w.add("", f"Platform: {plat.detail}.")
        return
    if npu_smi is None:
        where = probe.which("npu-smi")
        why = "npu-smi is not on PATH" if where is None else f"`{where} info` failed, timed out or printed nothing"
        w.not_read("NPU count and health", why)
        w.add("", f"Platform: {plat.detail}.")
        return
    # the one reading of the table (verl_npu.stack.detect): the count here is the count doctor checks
    table = read_npu_smi(npu_smi)
    rows = [(c.npu, c.chip, "" if c.device is None else c.device, c.name, c.health, c.bus_id) for c in table.chips]
    unhealthy = [c for c in table.chips if c.health.upper() != "OK"]
    if rows:
        w.add(f"{npus_phrase(len(rows), table.cards)} listed by `npu-smi info`; {len(unhealthy)} not OK.", "")
        w.add(*_table(("NPU", "chip", table.id_column or "device", "name", "health", "Bus-Id"), rows))
    else:
        w.add("No NPU listed by `npu-smi info`.", "")
        w.not_read("NPU health", "no NPU rows recognised in `npu-smi info` (its output is below)")
    w.add("", "<details><summary>npu-smi info</summary>", "", "```", npu_smi.rstrip(), "```", "", "</details>")


def _pairing(w: _Writer, probe: doctor.Probe, report: doctor.Report) -> None:
    w.section("torch, torch_npu and triton")
    rows = [(d, probe.version(d) or "not installed") for d in ("torch", "torch-npu", "triton", "triton-ascend")]
    w.add(*_table(("distribution", "installed"), rows), "")
    for f in report.findings:
        if f.check in ("torch.pairing", "triton"):
            w.add(f"- {f.check}: **{f.status}**: {f.detail}")


def _layer(w: _Writer, report: doctor.Report, layer_requested: bool) -> None:
    w.section("Runtime patches and the layer in a Ray worker")
    seen = report.layer
    if seen is None:
        why = "doctor ran with --no-layer" if not layer_requested else "the layer probe failed (see findings)"
        w.not_read("runtime patches (`verl-npu patches` in a fresh `import verl` process)", why)
        return
    process = seen.get("process", {})
    worker = seen.get("ray_worker")
    w.add(
        f"Fresh process: layer {'active' if process.get('active') else 'NOT active'}, platform "
        f"{process.get('platform', '?')}, VERL_USE_EXTERNAL_MODULES={process.get('external_modules')!r}."
    )
    if worker is None:
        w.add("")
        w.not_read("the layer in a Ray worker", "Ray is not installed, or doctor ran with --no-ray")
    elif worker.get("failed"):  # Ray could not run the check; the finding names the cause
        why = next((f.detail for f in report.findings if f.check == "layer.ray-worker"), str(worker.get("error")))
        w.add("")
        w.not_read("the layer in a Ray worker", why)
    else:
        w.add(
            f"Ray worker: layer {'active' if worker.get('active') else 'NOT active'}, platform "
            f"{worker.get('platform', '?')}; the runtime env forwards "
            f"{', '.join(worker.get('forwarded_variables', [])) or 'nothing'}."
        )
    patches = process.get("patches") or {}
    worker_patches = (worker or {}).get("patches") or {}
    if patches:
        w.add("")
        rows = [(pid, status, worker_patches.get(pid, "-")) for pid, status in sorted(patches.items())]
        w.add(*_table(("patch", "process", "Ray worker"), rows))


def _environment(w: _Writer, env: Mapping[str, str]) -> None:
    w.section("Environment (HCCL_*, ASCEND_*, VERL_*, RAY_*)")
    names = sorted(n for n in env if n.startswith(ENV_PREFIXES))
    if not names:
        w.add("None set.")
        return
    w.add(*_table(("variable", "value"), [(n, redact(n, env[n])) for n in names]))


def _findings(w: _Writer, report: doctor.Report) -> None:
    w.section("Findings")
    rows = [(f.check, f.status, f.detail, f.fix) for f in report.findings]
    w.add(*_table(("check", "status", "detail", "fix"), rows))


def render(
    report: doctor.Report, probe: doctor.Probe, stack: Stack, *, layer_requested: bool = True, now: str | None = None
) -> str:
    """The Markdown report of one doctor run."""
    w = _Writer()
    stamp = now or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    w.add(
        "# verl-npu doctor report",
        "",
        f"- generated {stamp} on `{socket.gethostname()}` by verl-npu {__version__}, Python "
        f"{_platform.python_version()} ({_platform.machine()})",
        f"- platform: {report.platform.detail}; checked as target **{report.target}**",
        f"- verdict: {checks.summary(report.findings)}",
    )
    _versions(w, probe, stack, report.target)
    npu_smi = _ascend_versions(w, probe)
    _npus(w, probe, report.platform, npu_smi)
    _pairing(w, probe, report)
    _layer(w, report, layer_requested)
    _environment(w, probe.env)
    _findings(w, report)
    w.section("Not read")
    w.add(*(f"- {what}: {why}" for what, why in w.unread) if w.unread else ["Everything was read."])
    # Everything above came from this node's environment, files and commands: no secret shape leaves it.
    return redact_text("\n".join(w.lines).rstrip() + "\n")


def write(text: str, path: Path) -> None:
    """Write the report whole or not at all, and only over a regular file (verl_npu.atomic): a reader never sees
    half of it, an old report survives a failure, a device or FIFO named as the report is refused (exit 2)."""
    from verl_npu import atomic

    atomic.write_text(path, text)
