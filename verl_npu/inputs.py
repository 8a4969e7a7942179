"""Values from outside verl-npu, parsed into typed, range-checked values before any arithmetic.

Every number or choice that comes from a launch script, a Hydra override, a composed verl config,
a model's config.json, the stack manifest, a CI baseline, a training log or an env file goes through
one of these parsers at the boundary where it is read. A bad value raises ``InputError``, whose
message names where the value came from, the key, the value and what is allowed; the CLI turns it
into one line and exit 2 (docs/errors.md). The arithmetic behind the boundary can then trust its
inputs: no negative parallel sizes, no fractional hidden sizes, no NaN limits.

Integers are strict: ``True`` is not 1, and ``2.5`` or ``2.0`` is not a tensor-parallel size (megatron
and verl would truncate or crash on them later). Decimal strings are accepted, since env files and
shell words carry text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

from verl_npu.errors import UserError

# Bounds no real launch comes near; they stop a hostile value before any loop or allocation uses it.
MAX_DEVICES = 1 << 20  # NPUs in one job (nnodes x devices per node)
MAX_PARALLEL = 1 << 16  # any one parallel size (TP, PP, CP, EP, DP)
MAX_TOKENS = 1 << 24  # one sequence (prompt + response)
MAX_BATCH = 1 << 24  # samples in one batch
MAX_LAYERS = 1 << 12  # transformer layers
MAX_HIDDEN = 1 << 20  # hidden, FFN and head sizes
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 14
MAX_HEADS = 1 << 14
MAX_GIB = float(1 << 20)  # memory in GiB (a PiB)

# ASCII only, as bash, Kubernetes and every tool a value reaches read it: Python's int() and float() also take
# Arabic-Indic or full-width digits, '1_6' and non-ASCII spaces, which would turn '١٦' into 16 here alone.
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ASCII_SPACE = " \t\n\r\f\v"  # str.strip() alone also strips U+3000 and U+00A0


class InputError(UserError):
    """A value from outside is missing, of the wrong type or out of range."""

    def __init__(self, key: str, value: object, allowed: str, *, source: str | None = None) -> None:
        self.key, self.value, self.allowed, self.source = key, value, allowed, source
        shown = _show(value)
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}={shown}: expected {allowed}")


class DuplicateKey(ValueError):
    """A key given twice in one JSON object: ``json.loads`` would keep the second value without a word."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"key {key[:80]!r} appears twice in one object (a reader keeps one of the two values; "
                         "keep the one you mean)")  # fmt: skip


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKey(key)
        obj[key] = value
    return obj


def loads_json(text: str) -> Any:
    """``json.loads`` that raises :class:`DuplicateKey` (a ValueError) for a key given twice in one object."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bound(value: float) -> str:
    """A bound as a person writes it: 4096 and 1048576 exactly (not 4.096e+03), 0.5 as 0.5."""
    if isinstance(value, int) or (math.isfinite(value) and value.is_integer() and abs(value) < 1e16):
        return str(int(value))
    return f"{value:g}"


def _range(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"from {_bound(minimum)} to {_bound(maximum)}"
    if minimum is not None:
        return f">= {_bound(minimum)}"
    if maximum is not None:
        return f"<= {_bound(maximum)}"
    return ""


def integer(key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            source: str | None = None) -> int:  # fmt: skip
    """An integer in [minimum, maximum]; decimal text is accepted, floats and booleans are not."""
    allowed = " ".join(filter(None, ("an integer", _range(minimum, maximum))))
    if isinstance(value, bool):
        raise InputError(key, value, allowed, source=source)
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip(_ASCII_SPACE)) and len(value) <= 40:
        value = int(value.strip(_ASCII_SPACE))
    if not isinstance(value, int):
        raise InputError(key, value, allowed, source=source)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InputError(key, value, allowed, source=source)
    return value


def number(key: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None, source: str | None = None) -> float:  # fmt: skip
    """A finite real number in range (``above``: strictly greater than); decimal text is accepted."""
    bounds = [b for b in (f"> {_bound(above)}" if above is not None else "", _range(minimum, maximum)) if b]
    allowed = " ".join(["a finite number", " and ".join(bounds)]) if bounds else "a finite number"
    given = value  # the message shows what was given ('0'), not its conversion (0.0)
    if isinstance(value, bool):
        raise InputError(key, given, allowed, source=source)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip(_ASCII_SPACE)) and len(value) <= 40:
        value = float(value.strip(_ASCII_SPACE))
    if not isinstance(value, (int, float)):
        raise InputError(key, given, allowed, source=source)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        raise InputError(key, given, allowed, source=source) from None
    if (
        not math.isfinite(value)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
        or (above is not None and value <= above)
    ):
        raise InputError(key, given, allowed, source=source)
    return value


def boolean(key: str, value: Any, *, source: str | None = None) -> bool:
    """true/false (YAML and Hydra give real booleans; text 'true'/'false' from env files is accepted)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InputError(key, value, "true or false", source=source)


def choice(key: str, value: Any, choices: Collection[str], *, source: str | None = None) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise InputError(key, value, "one of " + ", ".join(sorted(choices)), source=source)


def text(key: str, value: Any, *, max_length: int = 4096, source: str | None = None) -> str:
    if isinstance(value, str) and len(value) <= max_length:
        return value
    raise InputError(key, value, f"a string of at most {max_length} characters", source=source)


def mapping(key: str, value: Any, *, source: str | None = None) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    raise InputError(key, value, "a mapping (key: value table)", source=source)


def required(section: Mapping[str, Any], key: str, *, prefix: str = "", source: str | None = None) -> Any:
    """section[key], or an InputError naming the full dotted key when it is absent or null."""
    value = section.get(key) if isinstance(section, Mapping) else None
    if value is None:
        raise InputError(f"{prefix}{key}", None, "a value (it is missing)", source=source)
    return value


# Kubernetes resource quantities as `verl-npu k8s render` accepts them: a decimal number with an optional binary
# (Ki..Ei), decimal (k..E) or milli (m) suffix. The API server also takes exponents (1e3); a render never needs one.
_QUANTITY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?")
_QUANTITY_SCALE = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def _quantity_value(text: str) -> float | None:
    m = _QUANTITY.fullmatch(text)
    return float(m["number"]) * _QUANTITY_SCALE[m["suffix"]] if m else None


def quantity(key: str, value: Any, *, minimum: str | None = None, maximum: str | None = None,
             source: str | None = None) -> float:  # fmt: skip
    """A Kubernetes quantity (``512Gi``, ``64``, ``500m``) in base units (bytes, cores), within [minimum, maximum],
    which are quantities too and are shown as written."""
    bounds = " ".join(filter(None, (f"from {minimum}" if minimum else "", f"to {maximum}" if maximum else "")))
    allowed = " ".join(filter(None, ("a Kubernetes quantity (such as 512Gi, 64 or 500m)", bounds)))
    parsed = _quantity_value(value) if isinstance(value, str) and len(value) <= 40 else None
    if parsed is None:
        raise InputError(key, value, allowed, source=source)
    low = _quantity_value(minimum) if minimum else None
    high = _quantity_value(maximum) if maximum else None
    if (low is not None and parsed < low) or (high is not None and parsed > high):
        raise InputError(key, value, allowed, source=source)
    return parsed
