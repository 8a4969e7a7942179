"""What the doctor looks at: :class:`Probe`, and the small readers every rule shares.

Every rule reads a Probe, never the process directly, so tests drive each rule with a constructed
environment (fake site-packages trees, environment variables, command outputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import importlib.metadata
import os
import re
import resource
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_npu.bounded_read import NotReadable, read_bytes
from verl_npu.checks import Check as Finding
from verl_npu.cluster.network import check_network
from verl_npu.stack import build_manifest
from verl_npu.stack.detect import CommandFailed, run_command


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> str:
    """'2.10.0.post4' -> '2.10.0'; '2.10.0+cpu' -> '2.10.0'."""
    match = re.match(r"^\d+(\.\d+)*", version)
    return match.group(0) if match else version


def _read_version_file(path: Path) -> str | None:
    try:  # under an Ascend root named by the environment: never a FIFO's or a device's endless read
        text = read_bytes(path, 64 * 1024).decode(errors="replace")
    except NotReadable:
        return None
    match = re.search(r"^\s*(?:Version|version)\s*=\s*([0-9][0-9A-Za-z.\-]*)", text, flags=re.M)
    return match.group(1) if match else None


@dataclasses.dataclass
class Probe:
    """What the doctor looks at. ``Probe.current()`` reads this process and node."""

    env: Mapping[str, str]
    sys_path: Sequence[str]
    # stdout of a command, None when it is not on PATH, or how it failed (verl_npu.stack.detect.run_command)
    run: Callable[[Sequence[str]], str | CommandFailed | None] = run_command
    shm_path: Path = Path("/dev/shm")
    mem_total_bytes: int | None = None
    rlimits: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    build_manifest_path: Path | None = None
    ascend_root: Path = Path("/usr/local/Ascend")
    which: Callable[[str], str | None] = shutil.which
    # the node's network checks (verl_npu.cluster.network.check_network); None: not checked here
    network: Callable[[Mapping[str, str]], list[Finding]] | None = None
    # `verl-npu doctor --expect-npus N`, parsed: it wins over $VERL_NPU_EXPECT_NPUS, and findings name it as the source
    expect_npus: int | None = None

    @classmethod
    def current(cls) -> Probe:
        mem = None
        with contextlib.suppress(ValueError, OSError):
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(
            env=dict(os.environ),
            sys_path=list(sys.path),
            mem_total_bytes=mem,
            rlimits={
                "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK),
            },
            build_manifest_path=build_manifest.find(),
            meta_path=list(sys.meta_path),
            network=check_network,
        )

    # --- derived views (cached) -------------------------------------------------------------
    @property
    def distributions(self) -> dict[str, list[tuple[str, str]]]:
        """canonical name -> [(version, location)], every copy found on sys_path."""
        if not hasattr(self, "_dists"):
            found: dict[str, list[tuple[str, str]]] = {}
            seen: set[str] = set()
            for dist in importlib.metadata.distributions(path=list(self.sys_path)):
                name = dist.metadata["Name"]
                location = str(getattr(dist, "_path", ""))
                if not name or location in seen:
                    continue
                seen.add(location)
                found.setdefault(_canonical(name), []).append((dist.version, location))
            self._dists = found
        return self._dists

    def version(self, dist: str) -> str | None:
        copies = self.distributions.get(_canonical(dist))
        return copies[0][0] if copies else None

    meta_path: Sequence[Any] = ()  # import hooks such as editable installs' finders (current process only)

    def module_locations(self, dotted: str) -> list[str]:
        """Every sys_path entry (or import hook) that provides ``dotted``; the first one wins."""
        parts = dotted.split(".")
        starts = [[entry or "."] for entry in self.sys_path]
        for finder in self.meta_path:  # editable installs resolve their top-level package here
            if isinstance(finder, type) and issubclass(finder, importlib.machinery.PathFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            top = find_spec(parts[0], None) if find_spec is not None else None
            if top is not None and top.submodule_search_locations is not None:
                starts.append([str(Path(loc).parent) for loc in top.submodule_search_locations])
        locations = []
        for path in starts:
            spec = None
            for i, part in enumerate(parts):
                spec = importlib.machinery.PathFinder.find_spec(part, path)
                if spec is None:
                    break
                if i < len(parts) - 1:
                    path = list(spec.submodule_search_locations or [])
            if spec is not None and (spec.origin or spec.submodule_search_locations):
                origin = spec.origin or next(iter(spec.submodule_search_locations or []), "")
                if origin not in locations:
                    locations.append(origin)
        return locations
