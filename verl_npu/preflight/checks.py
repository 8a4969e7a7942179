"""The result type every preflight check returns, and the verdict over a list of them."""

from __future__ import annotations

import dataclasses

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclasses.dataclass(frozen=True)
class Check:
    area: str  # launch, config, engine, mesh, memory
    name: str  # a stable id, e.g. "unknown-key", "pp-layers"
    status: str  # ok, warn, fail
    message: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def verdict(checks: list[Check]) -> str:
    """ "go" unless any check failed."""
    return "no-go" if any(c.status == FAIL for c in checks) else "go"
