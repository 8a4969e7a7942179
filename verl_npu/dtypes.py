"""Every spelling of a dtype that verl-npu reads from a config, in one table: canonical name and bytes per element.

verl's and megatron's configs spell the same dtype several ways (``bf16``, ``bfloat16``; ``fp32``, ``float32``,
``32``; ``fp16``, ``float16``, ``16``). The engine's build plan and preflight's memory estimate both read them
through :func:`parse`, so a dtype the build plan accepts is the dtype the estimate counts; an unknown spelling is
a :class:`DtypeError`, never a silent default.
"""

from __future__ import annotations

from verl_npu.errors import UserError

# canonical name -> bytes per element
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int16": 2}
# every accepted spelling -> canonical name
ALIASES = {
    **{name: name for name in BYTES},
    "float32": "fp32",
    "32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "16": "fp16",
}


class DtypeError(UserError):
    """A dtype spelling no table here knows."""

    def __init__(self, value: object, what: str = "dtype"):
        self.value = value
        super().__init__(f"{what}={value!r}: unknown dtype; known spellings: {', '.join(ALIASES)}")


def parse(value: object, default: str | None = None, what: str = "dtype") -> str:
    """The canonical name of ``value`` (``None`` gives ``default``, itself parsed). Raises :class:`DtypeError`."""
    if value is None:
        if default is None:
            raise DtypeError(value, what)
        return parse(default, what=what)
    try:
        return ALIASES[str(value)]
    except KeyError:
        raise DtypeError(value, what) from None


def nbytes(value: object) -> int:
    """Bytes per element of any known spelling."""
    return BYTES[parse(value)]
