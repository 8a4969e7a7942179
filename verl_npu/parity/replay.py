"""Layer-by-layer replay: each module of a run fed another run's exact inputs, so a fault is named at its module.

A run records, per micro-batch of its evaluation batch, the residual stream at the boundaries of every block
(``natural``):

- ``layers.N.input``: decoder layer N's input (layer 0's is the embedding's output);
- ``layers.N.residual``: its hidden state after the attention block (input + attention), which the MLP block reads;
- ``final.input``: the last layer's output, which the final norm and the output layer read.

These are tensors every build of the model has, whatever its layer spec fuses (a fused input norm, a fused
attention kernel): the attention block is everything between ``input`` and ``residual``, the MLP block everything
between ``residual`` and the next ``input``.

A run made with ``--replay-from SOURCE`` evaluates the batch a second time with each block's input replaced by
SOURCE's natural tensor of that point (rounded to the run's dtype), and records what each block then adds
(``replayed``): ``layers.N.self_attention`` (its residual minus SOURCE's input) and ``layers.N.mlp`` (its output minus
SOURCE's residual), the log-probs from SOURCE's ``final.input``, and every DSA layer's top-k. Compared with SOURCE's
own contributions (verl_npu.parity.compare), each block's difference is that block's alone: no error is carried in
from the layers before it, so a bf16 comparison keeps its power at depth and the first failing block is the fault's.

Tensors are stored in the run's dtype, little-endian, zlib-compressed and base64-encoded; a SOURCE is identified by
the SHA-256 of its natural tensors (a run's ``replayed.source_digest``), so a comparison knows it holds the inputs
the run was fed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from verl_npu.errors import UserError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
MAX_ELEMENTS = 1 << 24  # one stored tensor: far above any parity model's, far below what a hostile file could ask


class ReplayError(UserError):
    """A stored tensor or replay source that cannot be used (malformed, another model's, incomplete): exit 2."""


def encode(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    name = next((k for k, v in DTYPES.items() if v == t.dtype), None)
    if name is None:
        raise ReplayError(f"a {t.dtype} tensor: the replay stores {', '.join(DTYPES)}")
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
    else:
        raw = t.numpy().astype("<f4" if t.dtype == torch.float32 else "<f8").tobytes()
    return {"shape": list(t.shape), "dtype": name, "data": base64.b64encode(zlib.compress(raw, 6)).decode()}


def decode(where: str, record: Any) -> torch.Tensor:
    """A stored tensor, checked: its dtype, shape and byte count must agree (a ReplayError names what does not)."""
    import numpy as np

    if not isinstance(record, Mapping):
        raise ReplayError(f"{where}: expected a stored tensor (shape, dtype, data), found {type(record).__name__}")
    dtype, shape, data = record.get("dtype"), record.get("shape"), record.get("data")
    if dtype not in DTYPES:
        raise ReplayError(f"{where}.dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and shape and all(type(n) is int and n > 0 for n in shape)):
        raise ReplayError(f"{where}.shape={shape!r}: expected a list of positive integers")
    count = 1
    for n in shape:
        count *= n
    if count > MAX_ELEMENTS:
        raise ReplayError(f"{where}.shape={shape}: {count} elements, more than {MAX_ELEMENTS}")
    width = {"bfloat16": 2, "float32": 4, "float64": 8}[dtype]
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(str(data), validate=True), count * width + 1)
    except (ValueError, zlib.error) as exc:
        raise ReplayError(f"{where}.data: not base64 zlib data ({exc})") from None
    if len(raw) != count * width:
        raise ReplayError(f"{where}.data: {len(raw)} bytes for shape {shape} in {dtype} ({count * width} expected)")
    if dtype == "bfloat16":
        return torch.from_numpy(np.frombuffer(raw, dtype="<i2").copy()).view(torch.bfloat16).reshape(shape)
    array = np.frombuffer(raw, dtype="<f4" if dtype == "float32" else "<f8").astype("=f4" if width == 4 else "=f8")
    return torch.from_numpy(array.copy()).reshape(shape)


def digest(natural: Mapping[str, Any]) -> str:
    """The identity of a set of natural tensors: SHA-256 over their names and stored data, in name order."""
    h = hashlib.sha256()
    for name in sorted(natural):
        record = natural[name]
        h.update(f"{name}\0{record.get('dtype')}\0{record.get('shape')}\0{record.get('data')}\0".encode())
    return h.hexdigest()


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _with_hidden(args: tuple, kwargs: dict, value: torch.Tensor) -> tuple[tuple, dict]:
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": value}
    return (value, *args[1:]), kwargs


class Recorder:
    """Hooks on one GPTModel's decoder layers and final norm; they act only inside :meth:`recording` (natural) or
    :meth:`replaying` (each block's input replaced by the source's)."""

    def __init__(self, gpt: Any):
        self.natural: dict[str, dict[str, Any]] = {}
        self.replayed: dict[str, dict[str, Any]] = {}
        self._prefix: str | None = None
        self._source: Mapping[str, torch.Tensor] | None = None
        self._straight_through = False  # a gradient probe: fed values, the gradient flows on to the block before
        self._handles: list[Any] = []
        layers = list(gpt.decoder.layers)
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_input(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._layer_output(index)))
            self._wrap_mlp(layer, index)
        final = getattr(gpt.decoder, "final_layernorm", None)
        if final is None:
            raise ReplayError("the model has no final_layernorm: the replay has no point before the output layer")
        self._handles.append(final.register_forward_pre_hook(self._final_input))

    # --- the points -------------------------------------------------------------------------------------------------
    def _point(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _feed(self, name: str, natural: torch.Tensor) -> torch.Tensor | None:
        """Record ``natural`` (recording) or return the source's tensor in its place (replaying)."""
        if self._prefix is None:
            return None
        point = self._point(name)
        if self._source is None:
            self.natural[point] = encode(natural)
            return None
        if point not in self._source:
            raise ReplayError(f"the replay source has no {point}: it was recorded from another model or batch")
        given = self._source[point]
        if tuple(given.shape) != tuple(natural.shape):
            raise ReplayError(
                f"the replay source's {point} has shape {tuple(given.shape)}, this run's "
                f"{tuple(natural.shape)}: another model or batch"
            )
        fed = given.to(device=natural.device, dtype=natural.dtype)
        if self._straight_through and natural.requires_grad:
            return natural + (fed - natural).detach()
        return fed

    def _layer_input(self, index: int):
        def hook(_module, args, kwargs):
            fed = self._feed(f"layers.{index}.input", _hidden(args, kwargs))
            return None if fed is None else _with_hidden(args, kwargs, fed)

        return hook

    def _layer_output(self, index: int):
        def hook(_module, _args, output):
            if self._prefix is not None and self._source is not None and not self._straight_through:
                hidden = output[0] if isinstance(output, (tuple, list)) else output
                self._contribution(f"layers.{index}.mlp", hidden, f"layers.{index}.residual")

        return hook

    def _wrap_mlp(self, layer: Any, index: int) -> None:
        forward_mlp = layer._forward_mlp

        def _forward_mlp(hidden_states, *args, **kwargs):
            if self._prefix is not None and self._source is not None and not self._straight_through:
                self._contribution(f"layers.{index}.self_attention", hidden_states, f"layers.{index}.input")
            fed = self._feed(f"layers.{index}.residual", hidden_states)
            return forward_mlp(hidden_states if fed is None else fed, *args, **kwargs)

        layer._forward_mlp = _forward_mlp

    def _final_input(self, _module, args):
        fed = self._feed("final.input", args[0])
        return None if fed is None else (fed, *args[1:])

    def _contribution(self, name: str, after: torch.Tensor, before: str) -> None:
        """What a block added to the source's input: stored as the block's output minus that input, in float64."""
        source = self._source[self._point(before)].to(torch.float64)
        added = after.detach().to("cpu", torch.float64) - source.to(after.dtype).to(torch.float64)
        self.replayed[self._point(name)] = encode(added)

    # --- modes ------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, micro_batch: int) -> Iterator[None]:
        self._prefix, self._source = f"mb{micro_batch}", None
        try:
            yield
        finally:
            self._prefix = None

    @contextlib.contextmanager
    def replaying(
        self, micro_batch: int, source: Mapping[str, torch.Tensor], straight_through: bool = False
    ) -> Iterator[None]:
        self._prefix, self._source, self._straight_through = f"mb{micro_batch}", source, straight_through
        try:
            yield
        finally:
            self._prefix, self._source, self._straight_through = None, None, False


def contributions(natural: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A run's own block contributions from its natural tensors (float64): what its replay outputs are compared to."""
    out = {}
    for point in natural:
        prefix, _, name = point.partition("/")
        if not (name.startswith("layers.") and name.endswith(".input")):
            continue
        index = int(name[len("layers.") : -len(".input")])
        residual = natural.get(f"{prefix}/layers.{index}.residual")
        after = natural.get(f"{prefix}/layers.{index + 1}.input", natural.get(f"{prefix}/final.input"))
        if residual is None or after is None:
            raise ReplayError(f"{point}: the natural tensors lack layer {index}'s residual or the next block's input")
        out[f"{prefix}/layers.{index}.self_attention"] = residual.double() - natural[point].double()
        out[f"{prefix}/layers.{index}.mlp"] = after.double() - residual.double()
    return out
