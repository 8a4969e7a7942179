"""Record, while megatron's DSAttention.forward runs, whether its 2-D float mask is the causal one.

Changes: wraps ``megatron.core...dsa.DSAttention.forward``; for the duration of the call a context
variable says the call is inside DSAttention and whether ``attn_mask_type`` is causal. Nothing else
changes. The chunked DSA patches (dsa-indexer-without-loss, dsa-indexer-loss-chunked,
dsa-indexer-topk-eval) read it through ``causal_dsa_mask()`` and ``inside_dsa_attention()``.
Why: those patches replace functions that receive only a float mask. DSAttention's causal branch
passes a 2-D ``[sq, skv]`` upper-triangular -inf mask, which the chunked code reproduces without
building it; but its padding branch squeezes a ``[b, 1, sq, skv]`` attention mask, which is 2-D too
when b = 1. The mask's shape cannot tell them apart (checking its values would read an [s, s]
tensor); the caller's ``attn_mask_type`` can. Outside a causal DSAttention call the patches run
megatron's code unchanged.
Upstream: megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py (DSAttention.forward).
Remove when: the chunked DSA patches are removed (see theirs).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE

# None outside DSAttention.forward; inside it, whether its attn_mask_type is causal
_CAUSAL = contextvars.ContextVar("verl_npu_dsa_attention_causal", default=None)


def inside_dsa_attention() -> bool:
    return _CAUSAL.get() is not None


def causal_dsa_mask() -> bool:
    """True inside a DSAttention.forward whose mask is causal (its 2-D float mask is the triu -inf one)."""
    return _CAUSAL.get() is True


@contextlib.contextmanager
def dsa_attention_call(causal: bool):
    """What the wrapped DSAttention.forward sets for its duration (tests use it to stand in for the call)."""
    token = _CAUSAL.set(bool(causal))
    try:
        yield
    finally:
        _CAUSAL.reset(token)


def _build(original):
    from megatron.core.transformer.enums import AttnMaskType

    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        mask_type = signature.bind(*args, **kwargs).arguments.get("attn_mask_type")
        with dsa_attention_call(mask_type == AttnMaskType.causal):
            return original(*args, **kwargs)

    return forward


PATCH = Patch(
    id="dsa-call-context",
    target=f"{DSA_MODULE}:DSAttention.forward",
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="4ed023882ef6a032906cc5636f9def6169179307a67d3e2e99454b1e5a82bdbc",
    reason="the chunked DSA patches must know whether a 2-D float mask is DSAttention's causal mask (a b=1 padding "
    "mask is 2-D too); DSAttention.forward records its attn_mask_type for them",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::DSAttention.forward",
    remove_when="the chunked DSA patches (dsa-indexer-without-loss, dsa-indexer-loss-chunked, dsa-indexer-topk-eval) "
    "are removed",
    build=_build,
)
PATCHES = (PATCH,)
