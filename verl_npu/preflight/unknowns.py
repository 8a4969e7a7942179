"""Values only running the launch would tell (``<$(date +%Y%m%d)>``), carried through Hydra and verl as sentinels.

The launch reader keeps what it cannot know statically as a visible placeholder (``verl_npu.preflight.shell``). Such
text is no Hydra override value (``$(``, ``<`` and spaces are Hydra syntax), so composing it as-is would make
preflight refuse a launch that is fine (``trainer.experiment_name=run_$(date +%Y%m%d)``). Before composition each
placeholder becomes a sentinel made of letters, digits and underscores (:func:`for_hydra`), which Hydra and YAML
take as a plain string. A key whose value preflight computes with (a size, a switch) then refuses the sentinel by
name in :mod:`verl_npu.preflight.values` ("only known when the launch runs"), so an unknown value is never
range-checked as if it were known, and never a GO; a key it does not compute with (a run name) stays a warning.
The report shows the placeholder again wherever a sentinel appears in a message (:func:`restore`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

PREFIX = "VERL_NPU_UNKNOWN_"
_SENTINEL = re.compile(PREFIX + r"(\d+)(?!\d)")


def contains(value: object) -> bool:
    """Whether ``value`` is text holding a sentinel (a value only the running launch knows)."""
    return isinstance(value, str) and _SENTINEL.search(value) is not None


def for_hydra(overrides: Sequence[str], placeholders: Iterable[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The overrides with each placeholder replaced by its sentinel, and sentinel -> placeholder.

    Longer placeholders are replaced first, so one that contains another (``<$(a <$(b)>)>``) stays whole.
    """
    found = [p for p in placeholders if any(p in o for o in overrides)]
    mapping = {f"{PREFIX}{i}": p for i, p in enumerate(sorted(found, key=len, reverse=True))}
    out = []
    for override in overrides:
        for sentinel, placeholder in mapping.items():
            override = override.replace(placeholder, sentinel)
        out.append(override)
    return tuple(out), mapping


def restore(text: str, mapping: Mapping[str, str]) -> str:
    """``text`` with each sentinel shown as the placeholder it stands for."""
    if not mapping or PREFIX not in text:
        return text
    return _SENTINEL.sub(lambda m: mapping.get(m[0], m[0]), text)
