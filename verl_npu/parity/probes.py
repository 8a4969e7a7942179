"""What a parity run records inside the model: activation checksums at fixed points and each DSA layer's top-k.

Points, in forward order (layer numbers from 0, as in the HF checkpoint): ``embedding``; per decoder layer
``layers.N.indexer.k_norm``, ``layers.N.indexer.q`` and ``layers.N.indexer.k`` (a full DSA layer's indexer: its
key norm, and query and key as the index scores see them, after RoPE and any Hadamard rotation),
``layers.N.self_attention``, ``layers.N.mlp`` and ``layers.N`` (the layer's output); ``final_layernorm``;
``logits``. Each is recorded as the mean and the root-mean-square of the tensor and the mean of its rows
projected on a fixed vector (``proj``; the vector comes from the counter-based generator, one per row length), in
float64. The projection sees what mean and RMS cannot: a rotation (a Hadamard transform preserves the RMS and,
for isotropic rows, the mean), a permutation (a RoPE pair layout) or a sign flip of the features. These are tensors
every build of the model has, whatever its layer spec fuses (TE and TE-NPU fold the input norms into the next
linear, so a norm's own output is not a point; its effect shows in the module after it). The indexer's q and k
exist only where the indexer runs in PyTorch: inside MindSpeed's fused lightning indexer they are never
materialised, and such a run records ``indexer_qk: false``.

Top-k: every DSA layer's selection (verl_npu.engine.index_share records the top-k each layer's sparse attention
runs with, full and shared), stored per query row as sorted key indices. Where the exact rows of a long sequence would
outgrow the record (``TOPK_KEYS``), a sample of them is stored exactly and every query row is stored restricted to a
fixed sample of the keys (``all_rows``: one key in ``rate``, the same keys on every platform, bits packed): the
selection of every row is then compared, each within about 1/sqrt(k/rate) of its overlap and their sum far closer
(docs/parity.md, "Top-k over every query row").
"""

from __future__ import annotations

import base64
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

# the query rows of a [b, s, k] top-k a run stores: at most this many, and at most TOPK_KEYS keys in all
MAX_TOPK_ROWS = 256
TOPK_KEYS = 16384
# all_rows: the key sample keeps about this many of a row's k selected keys (one key in k // SAMPLED_KEYS)
SAMPLED_KEYS = 64
# the largest [b, s] a record's all_rows may claim (a parity run's is 2 x 2048): decoding walks every query row
MAX_ALL_ROWS_QUERIES = 1 << 20


def _tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


STATISTICS = ("mean", "rms", "proj")


def checksum(t: torch.Tensor) -> dict[str, float]:
    """``t``'s mean, root-mean-square and rows projected on the fixed vector of its row length.

    On the host, in float64, with exactly rounded sums (``math.fsum``): two platforms that hold the same tensor
    record the same checksum bit for bit, and no device needs float64 arithmetic (Ascend's has little).
    """
    from verl_npu.parity.models import uniform

    x = t.detach().to("cpu", torch.float64).numpy()
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    direction = uniform(f"probe/direction/{rows.shape[-1]}", rows.shape[-1])
    n = x.size
    return {
        "mean": math.fsum(x.ravel()) / n,
        "rms": math.sqrt(math.fsum((x * x).ravel()) / n),
        "proj": math.fsum((rows * direction).ravel()) / rows.shape[0],
    }


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class Probes:
    """Forward hooks on one GPTModel; they record only inside :meth:`recording`."""

    def __init__(self, gpt: Any):
        self.records: list[dict[str, Any]] = []
        self.indexer_qk = False
        self._seen: dict[str, int] = {}
        self._prefix: str | None = None
        self._handles = []
        self._hook(gpt.embedding, "embedding")
        for i, layer in enumerate(gpt.decoder.layers):
            core = getattr(layer.self_attention, "core_attention", None)
            indexer = getattr(core, "indexer", None)
            if indexer is not None and hasattr(indexer, "k_norm"):  # a full DSA layer (a shared one has NoIndexer)
                self._hook(indexer.k_norm, f"layers.{i}.indexer.k_norm")
                self._wrap_indexer(indexer, i)
            self._hook(layer.self_attention, f"layers.{i}.self_attention")
            self._hook(layer.mlp, f"layers.{i}.mlp")
            self._hook(layer, f"layers.{i}")
        if getattr(gpt.decoder, "final_layernorm", None) is not None:
            self._hook(gpt.decoder.final_layernorm, "final_layernorm")

    def _record(self, point: str, tensor: torch.Tensor | None) -> None:
        if self._prefix is None or tensor is None:
            return
        name = f"{self._prefix}/{point}"
        count = self._seen[name] = self._seen.get(name, 0) + 1
        # a module that runs twice in one forward (it should not) is recorded as name#2, never over the first
        self.records.append({"point": name if count == 1 else f"{name}#{count}", **checksum(tensor)})

    def _hook(self, module: torch.nn.Module, point: str) -> None:
        self._handles.append(module.register_forward_hook(lambda _m, _a, out: self._record(point, _tensor(out))))

    def _wrap_indexer(self, indexer: torch.nn.Module, layer: int) -> None:
        original = indexer.forward_before_topk

        def forward_before_topk(*args, **kwargs):
            q, k, weights = original(*args, **kwargs)
            self.indexer_qk = True
            self._record(f"layers.{layer}.indexer.q", q)
            self._record(f"layers.{layer}.indexer.k", k)
            return q, k, weights

        indexer.forward_before_topk = forward_before_topk

    def logits(self, logits: torch.Tensor) -> None:
        self._record("logits", logits)

    @contextlib.contextmanager
    def recording(self, micro_batch: int) -> Iterator[None]:
        self._prefix = f"mb{micro_batch}"
        try:
            yield
        finally:
            self._prefix = None


def topk_record(kind: str, indices: torch.Tensor) -> dict[str, Any]:
    """One layer's selection for one micro-batch: sorted key indices per stored query row (-1 padding dropped),
    packed as little-endian uint16 (int32 from 64k keys on) and base64."""
    b, s, k = indices.shape
    every_row = judged_rows(b, s, k)
    rows = every_row
    budget = max(1, min(MAX_TOPK_ROWS, TOPK_KEYS // max(k, 1)))
    if len(rows) > budget:
        step = len(rows) / budget
        rows = [rows[int(n * step)] for n in range(budget)]
    cpu = indices.detach().to("cpu", torch.int64)
    sampled = None if len(rows) == len(every_row) else _all_rows(cpu, every_row, k)
    packed, lengths = [], []
    for i, j in rows:
        keys = sorted({int(x) for x in cpu[i, j].tolist() if 0 <= int(x) <= j})
        packed += keys
        lengths.append(len(keys))
    width = "<u2" if max(packed, default=0) < 1 << 16 else "<i4"  # key indices of sequences up to 64k fit in 16 bits
    data = torch.tensor(packed, dtype=torch.int64).numpy().astype(width).tobytes()
    record = {
        "kind": kind,
        "k": k,
        "rows": rows,
        "lengths": lengths,
        "width": width,
        "keys": base64.b64encode(data).decode(),
    }
    if sampled is None:
        record["every_row"] = True
    else:
        record["all_rows"] = sampled
    return record


def judged_rows(b: int, s: int, k: int) -> list[tuple[int, int]]:
    """The (sequence, query) rows whose selection is compared: queries past the first k select among more keys than
    k, and only there does the selection decide anything (every row where none does)."""
    return [(i, j) for i in range(b) for j in range(s) if j >= k] or [(i, j) for i in range(b) for j in range(s)]


def key_sample(rate: int, length: int) -> Any:
    """The keys ``all_rows`` keeps: a fixed pseudo-random one in ``rate`` of key indices 0..length-1 (a bool array),
    the same on every platform (the counter-based generator), spread over the sequence as a stride is not (a stride
    would align with positional patterns)."""
    import numpy as np

    from verl_npu.parity.models import uniform

    if rate == 1:
        return np.ones(length, dtype=bool)
    return uniform(f"probe/topk-key-sample/{rate}", length) < -1.0 + 2.0 / rate


def _all_rows(cpu: torch.Tensor, rows: list[tuple[int, int]], k: int) -> dict[str, Any]:
    """Every row's selection restricted to :func:`key_sample`: per row, one bit per sampled key <= the query."""
    import numpy as np

    b, s, _ = cpu.shape
    rate = max(1, k // SAMPLED_KEYS)
    sample = key_sample(rate, s)
    selected = np.zeros((b, s, s + 1), dtype=bool)  # column s collects -1 padding and keys past the query
    idx = cpu.numpy()
    query = np.arange(s)[None, :, None]
    idx = np.where((idx >= 0) & (idx <= query), idx, s)
    np.put_along_axis(selected, idx, True, axis=2)
    bits = [selected[i, j, : j + 1][sample[: j + 1]] for i, j in rows]
    packed = np.packbits(np.concatenate(bits)) if bits else np.zeros(0, dtype=np.uint8)
    return {"rate": rate, "shape": [b, s], "bits": base64.b64encode(packed.tobytes()).decode()}


def all_rows_sets(record: dict[str, Any]) -> dict[tuple[int, int], frozenset[int]] | None:
    """Every judged row's selection within the key sample, (sequence, query) -> selected sampled keys: from
    ``all_rows``, or the exact rows where they are every row; None where the record has neither (an older run)."""
    import numpy as np

    k = int(record["k"])
    sampled = record.get("all_rows")
    if sampled is None:
        return topk_sets(record) if record.get("every_row") is True else None
    rate, shape = sampled.get("rate"), sampled.get("shape")
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
        raise ValueError(f"all_rows.rate={rate!r}: expected an integer >= 1")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise ValueError(f"all_rows.shape={shape!r}: expected [sequences, queries]")
    b, s = shape
    if b * s > MAX_ALL_ROWS_QUERIES:
        raise ValueError(f"all_rows.shape={shape!r}: {b * s} query rows, more than {MAX_ALL_ROWS_QUERIES} a run has")
    sample = key_sample(rate, s)
    rows = judged_rows(b, s, k)
    counts = np.cumsum(sample)  # sampled keys <= query j: counts[j]
    needed = int(sum(counts[j] for _, j in rows))
    bits = np.unpackbits(np.frombuffer(base64.b64decode(sampled["bits"], validate=True), dtype=np.uint8))
    if len(bits) != (needed + 7) // 8 * 8 or bits[needed:].any():
        raise ValueError(f"all_rows.bits: {len(bits)} bits for rows of {needed} sampled keys")
    keys = np.flatnonzero(sample)
    out, start = {}, 0
    for i, j in rows:
        n = int(counts[j])
        out[(i, j)] = frozenset(int(x) for x in keys[:n][bits[start : start + n].astype(bool)])
        start += n
    return out


def topk_sets(record: dict[str, Any]) -> dict[tuple[int, int], frozenset[int]]:
    """The stored rows of a :func:`topk_record` as (sequence, query) -> selected keys."""
    import numpy as np

    width = record.get("width")
    if width not in ("<u2", "<i4"):
        raise ValueError(f"width={width!r}: expected '<u2' or '<i4'")
    flat = np.frombuffer(base64.b64decode(record["keys"], validate=True), dtype=width)
    if len(flat) != sum(record["lengths"]):
        raise ValueError(f"{len(flat)} keys for rows of {sum(record['lengths'])}")
    out, start = {}, 0
    for (i, j), n in zip(record["rows"], record["lengths"], strict=True):
        out[(int(i), int(j))] = frozenset(int(x) for x in flat[start : start + n])
        start += n
    return out
