"""Stand-ins for the torch_npu operators that verl_npu.ops.ascend calls, for tests without an NPU.

Each function has exactly the signature torch-npu 2.10.0.post4 registers (recorded in
verl_npu/contracts/torch_npu.py, checked against the wheel; tests_npu/contracts/test_contracts.py compares the
two), asserts the input rules the operator
documents or its kernel checks (dtypes, BSND layout, contiguity, int32 indices in the
valid-first-then--1 form, head counts and dims, modes), so an adapter that hands the real operator
something it would refuse fails here, and computes the documented result with plain PyTorch in
fp32, differentiable where torch_npu registers a gradient. Only the BSND, non-paged forms the
adapters use are covered. ``module()`` builds a ``torch_npu`` module for ``sys.modules``; its
``CALLS`` lists the operators that ran, so a test can tell the fused path from a fallback.
``install_runtime()`` adds the device runtime that vllm-ascend's import path and verl's weight sync touch (one
operator, device queries, names), for tests_npu/support/vllm_cpu.py's fresh interpreter.
"""

from __future__ import annotations

import types

import torch

from verl_npu.contracts.torch_npu import INDEXER_SPARSE_COUNTS

INT64_MAX = 2**63 - 1
LOW_PRECISION = (torch.bfloat16, torch.float16)


# Documented input rules a test may record instead of enforce (see RECORDED).
CONTIGUITY, LOW_PRECISION_INPUTS = "contiguity", "low-precision inputs"


def _rule(condition: bool, message: str, kind: str | None = None) -> None:
    if condition:
        return
    if kind is not None and RECORDED is not None and kind in RECORDED:
        RECORDED[kind].append(f"{CALLS[-1] if CALLS else '?'}: {message}")
        return
    raise AssertionError(f"torch_npu would refuse this call: {message}")


def _contiguous(**tensors: torch.Tensor) -> None:
    """torch_npu documents these operators' tensor inputs as not taking non-contiguous tensors ("不支持非连续")."""
    for name, tensor in tensors.items():
        _rule(tensor.is_contiguous(), f"{name} must be contiguous (the operator takes no strided tensors)", CONTIGUITY)


# None: every rule is enforced (verl-npu's own adapters are held to them all). A dict {kind: []}: a broken rule of
# one of those kinds is recorded in its list and the call goes on, computing the documented result from what it was
# given. tests_npu/support/ascend_sim.py records CONTIGUITY for upstream code it runs but does not own (whether the
# hardware takes MindSpeed's split views only a node can tell), and LOW_PRECISION_INPUTS for the fp32 run that
# measures MindSpeed's fused composition at fp32 rounding (a launch runs it in bf16, every rule enforced).
RECORDED: dict[str, list[str]] | None = None


def _lengths(name: str, lengths, batch: int, full: int) -> None:
    if lengths is not None:
        _rule(lengths.dtype == torch.int32 and lengths.shape == (batch,), f"{name} must be int32 [B={batch}]")
        _rule(bool((lengths == full).all()), f"{name}: the stand-in covers full-length rows only")


def _causal_limit(s1: int, s2: int, device) -> torch.Tensor:
    """[1, s1, 1]: sparse_mode=3 lets query i see keys j <= s2 - s1 + i (the diagonal ends bottom-right)."""
    return (s2 - s1 + torch.arange(s1, device=device)).view(1, s1, 1)


def _check_sparse_indices(indices: torch.Tensor, batch: int, s1: int, s2: int) -> torch.Tensor:
    """The [B, S1, 1, K] int32 indices' documented form; returns the valid-entry mask [B, S1, K]."""
    _rule(indices.dtype == torch.int32, f"sparse_indices must be int32, got {indices.dtype}")
    _rule(
        indices.dim() == 4 and indices.shape[:3] == (batch, s1, 1) and indices.shape[3] > 0,
        f"sparse_indices must be [B={batch}, S1={s1}, 1, K>0], got {tuple(indices.shape)}",
    )
    _contiguous(sparse_indices=indices)
    idx = indices[:, :, 0].long()
    valid = idx >= 0
    _rule(bool((idx[valid] < s2).all()), "sparse_indices must lie in [0, S2) or be -1")
    # every row: its valid entries first, the -1 padding after them
    _rule(bool((valid[..., 1:] <= valid[..., :-1]).all()), "each sparse_indices row: valid entries first, -1 after")
    return valid


def _listed(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """scores [B, S1, N, S2] of every key, idx [B, S1, K] (>= 0) -> [B, S1, N, K]: each row's listed keys, in order."""
    return scores.gather(-1, idx.unsqueeze(2).expand(-1, -1, scores.shape[2], -1))


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """Stands in for ``torch_npu.npu_rms_norm(self, gamma, epsilon) -> (y, rstd)``.

    y = self * rstd * gamma in self's dtype, rstd = 1/sqrt(mean(self^2) + epsilon) in fp32 over
    gamma's dims; gamma must have self's dtype. Differentiable (torch_npu: npu_rms_norm_backward).
    """
    CALLS.append("npu_rms_norm")
    _rule(self.dtype in (*LOW_PRECISION, torch.float32), f"self must be fp16/bf16/fp32, got {self.dtype}")
    _rule(gamma.dtype == self.dtype, f"gamma must have self's dtype {self.dtype}, got {gamma.dtype}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    rstd = torch.rsqrt(self.float().pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (self.float() * rstd * gamma.float()).to(self.dtype), rstd


def npu_lightning_indexer(
    query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3, pre_tokens=INT64_MAX,
    next_tokens=INT64_MAX, return_value=False,
):  # fmt: skip
    """Stands in for ``torch_npu.npu_lightning_indexer(...) -> (sparse_indices, sparse_values)``.

    BSND: query [B, S1, N1, 128] (N1 <= 64), key [B, S2, 1, 128] of query's fp16/bf16 dtype, weights
    [B, S1, N1] in that dtype or fp32. sparse_count: 1..2048 or a multiple of 1024 up to 8192. Score
    of key j for query i: sum_h weights[h] * relu(query[h] . key[j]) (fp32); sparse_mode=3 keeps
    keys j <= S2 - S1 + i, 0 keeps all. Returns the top ``sparse_count`` keys per row, best first,
    int32 [B, S1, 1, sparse_count], a row's missing keys as -1 after its valid ones; the values
    (query's dtype) only with ``return_value``. Indices carry no gradient.
    """
    CALLS.append("npu_lightning_indexer")
    _rule(layout_query == layout_key == "BSND", "the stand-in covers layout BSND only")
    _rule(block_table is None, "block_table is for layout_key PA_BSND only")
    _rule(
        query.dtype in LOW_PRECISION and key.dtype == query.dtype and weights.dtype in (query.dtype, torch.float32),
        f"query, key: one dtype, fp16 or bf16, weights that or fp32; got {query.dtype}, {key.dtype}, {weights.dtype}",
    )
    _contiguous(query=query, key=key, weights=weights)
    _rule(query.dim() == 4 and key.dim() == 4, "BSND query and key are 4-D")
    batch, s1, heads, dim = query.shape
    s2 = key.shape[1]
    _rule(dim == 128 and key.shape == (batch, s2, 1, 128), f"head dim 128 and one key head; key {tuple(key.shape)}")
    _rule(1 <= heads <= 64, f"query heads must be <= 64, got {heads}")
    _rule(weights.shape == (batch, s1, heads), f"weights must be [B, S1, N1], got {tuple(weights.shape)}")
    _rule(sparse_count in INDEXER_SPARSE_COUNTS, f"sparse_count: 1..2048 or 3072..8192 step 1024, got {sparse_count}")
    _rule(sparse_mode in (0, 3), f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _rule(pre_tokens == next_tokens == INT64_MAX, "pre_tokens/next_tokens: only the default")
    _lengths("actual_seq_lengths_query", actual_seq_lengths_query, batch, s1)
    _lengths("actual_seq_lengths_key", actual_seq_lengths_key, batch, s2)
    with torch.no_grad():
        scores = torch.einsum("bshd,btd->bsht", query.float(), key[:, :, 0].float()).relu()
        scores = (scores * weights.float().unsqueeze(-1)).sum(2)
        if sparse_mode == 3:
            keys = torch.arange(s2, device=query.device).view(1, 1, s2)
            scores.masked_fill_(keys > _causal_limit(s1, s2, query.device), float("-inf"))
        kept = min(sparse_count, s2)
        values, indices = scores.topk(kept, dim=-1)
        indices = indices.masked_fill(values == float("-inf"), -1)
        pad = sparse_count - kept
        indices = torch.nn.functional.pad(indices, (0, pad), value=-1).to(torch.int32).unsqueeze(2).contiguous()
        values = torch.nn.functional.pad(values, (0, pad), value=float("-inf")).to(query.dtype).unsqueeze(2)
    return indices, values if return_value else torch.empty(0, dtype=query.dtype)


def npu_sparse_flash_attention(
    query, key, value, sparse_indices, scale_value, *, block_table=None, actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None, query_rope=None, key_rope=None, sparse_block_size=1, layout_query="BSND",
    layout_kv="BSND", sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=0,
    return_softmax_lse=False,
):  # fmt: skip
    """Stands in for ``torch_npu.npu_sparse_flash_attention(...) -> (attention_out, softmax_max, softmax_sum)``.

    attention_mode=2 (absorbed MLA, the only mode documented): query [B, S1, N1, 512] and
    query_rope [B, S1, N1, 64]; key [B, S2, 1, 512], key_rope [B, S2, 1, 64]; value [B, S2, 1, 512]
    (absorbed MLA's latent values; its own tensor or the key's). One fp16/bf16 dtype. Row i attends
    to the keys listed in sparse_indices[b, i, 0] (int32, valid first, -1 after; each listed key is
    gathered, so a repeated one counts twice), those after S2 - S1 + i masked (sparse_mode=3), with
    softmax(scale * [q, q_rope] . [k, k_rope]). attention_out is query-shaped in query's dtype; with
    ``return_softmax_lse`` softmax_max/softmax_sum are fp32 [B, 1, S1, N1]: the row max of the
    scaled scores and the sum of exp(score - max) (UNCONFIRMED that the scale is applied before the
    max; only the operator's own backward and the KL-loss operator read them). Differentiable w.r.t.
    query, key, value, query_rope, key_rope (torch_npu: npu_sparse_flash_attention_grad).
    """
    CALLS.append("npu_sparse_flash_attention")
    _rule(layout_query == layout_kv == "BSND", "the stand-in covers layout BSND only")
    _rule(block_table is None, "block_table (PA_BSND) is not covered")
    _rule(attention_mode == 2, f"attention_mode: only 2 (absorbed MLA) is supported, got {attention_mode}")
    _rule(query_rope is not None and key_rope is not None, "attention_mode=2 needs query_rope and key_rope")
    _rule(sparse_block_size == 1 and sparse_mode in (0, 3), "sparse_block_size 1, sparse_mode 0 or 3")
    _rule(pre_tokens == next_tokens == INT64_MAX, "pre_tokens/next_tokens: only the default")
    tensors = dict(query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope)
    _rule(
        query.dtype in LOW_PRECISION and all(t.dtype == query.dtype for t in tensors.values()),
        f"one fp16/bf16 dtype: { ({n: t.dtype for n, t in tensors.items()}) }",
        LOW_PRECISION_INPUTS,
    )
    _contiguous(**tensors)
    batch, s1, heads, dim = query.shape
    s2 = key.shape[1]
    _rule(heads in (1, 2, 4, 8, 16, 32, 64, 128), f"query heads must be a power of two <= 128, got {heads}")
    _rule(dim == 512 and key.shape == (batch, s2, 1, 512), f"query/key D 512, one key head: key {tuple(key.shape)}")
    _rule(query_rope.shape == (batch, s1, heads, 64) and key_rope.shape == (batch, s2, 1, 64), "rope D 64")
    _rule(value.shape == key.shape, f"value: [B, S2, 1, 512] like key, got {tuple(value.shape)}")
    _lengths("actual_seq_lengths_query", actual_seq_lengths_query, batch, s1)
    _lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch, s2)
    valid = _check_sparse_indices(sparse_indices, batch, s1, s2)
    idx = sparse_indices[:, :, 0].long().clamp(min=0)
    if sparse_mode == 3:
        valid = valid & (idx <= _causal_limit(s1, s2, query.device))
    q = torch.cat((query, query_rope), dim=-1).float()  # [B, S1, N1, 576]
    # every key's score, then the listed ones picked (a [B, S1, N1, S2] buffer, not [B, S1, K, 576] gathered keys)
    scores = _listed(torch.einsum("bsnd,btd->bsnt", q, torch.cat((key, key_rope), dim=-1)[:, :, 0].float()), idx)
    scores = (scores * scale_value).masked_fill(~valid.unsqueeze(2), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    weights = torch.zeros(*exp.shape[:3], s2, dtype=exp.dtype, device=exp.device)
    weights = weights.scatter_add(-1, idx.unsqueeze(2).expand_as(exp), exp / row_sum)  # a repeated key: twice
    out = torch.einsum("bsnt,btd->bsnd", weights, value[:, :, 0].float()).to(query.dtype)
    if not return_softmax_lse:
        empty = torch.empty(0, dtype=torch.float32, device=query.device)
        return out, empty, empty
    stats = (row_max.squeeze(-1).detach().unsqueeze(1), row_sum.squeeze(-1).detach().unsqueeze(1))
    return out, *(t.contiguous() for t in stats)  # [B, 1, S1, N1]


def npu_sparse_lightning_indexer_grad_kl_loss(
    query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, scale_value, *,
    query_rope=None, key_rope=None, actual_seq_qlen=None, actual_seq_klen=None, layout="BSND", sparse_mode=3,
    pre_tokens=INT64_MAX, next_tokens=INT64_MAX,
):  # fmt: skip
    """Stands in for ``torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(...) -> (d_query_index, d_key_index,
    d_weights, loss)``.

    BSND, sparse_mode=3, absorbed-MLA main attention: query [B, S1, N1, 512] (N1 in 32, 64, 128: the
    TP-gathered heads) with query_rope [.., 64], key [B, S2, 1, 512] with key_rope; indexer
    query_index [B, S1, Nidx1, D] (Nidx1 in 8, 16, 32, 64), key_index [B, S2, 1, D], weights
    [B, S1, Nidx1] (fp16/bf16 or fp32); sparse_indices int32 [B, S1, 1, K], K a multiple of 1024 up
    to 8192; softmax_max/softmax_sum fp32 [B, 1, S1, N1] from npu_sparse_flash_attention;
    actual_seq_qlen/klen are int lists (TND only).
    Over each row's selected causal keys: p = L1-normalised sum over heads of
    exp(scale * q . k - softmax_max) / softmax_sum; I = sum_h weights_h * relu(query_index_h .
    key_index); loss = sum over the B * S1 rows of KL(p || softmax(I)) as fp32 [1]; the gradients
    are those of that summed loss (dI = softmax(I) - p) in the inputs' dtypes.
    """
    CALLS.append("npu_sparse_lightning_indexer_grad_kl_loss")
    _rule(layout == "BSND" and sparse_mode == 3, "the stand-in covers layout BSND; sparse_mode: only 3")
    # sparse_mode 3 ignores pre_tokens/next_tokens (torch_npu documents it so for its fused-attention family, and
    # this operator's own documented example passes 65536 for both in mode 3, as MindSpeed's fused DSA does)
    _rule(isinstance(pre_tokens, int) and isinstance(next_tokens, int), "pre_tokens/next_tokens are integers")
    for name, lengths in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_klen", actual_seq_klen)):
        _rule(
            lengths is None or (isinstance(lengths, list | tuple) and all(isinstance(n, int) for n in lengths)),
            f"{name} is an int list (SymInt[]), got {type(lengths).__name__}",
        )
        _rule(lengths is None, f"{name} is for layout TND, which the stand-in does not cover")
    same = dict(query=query, key=key, query_index=query_index, key_index=key_index)
    _rule(
        query.dtype in LOW_PRECISION and all(t.dtype == query.dtype for t in same.values()),
        f"query, key, query_index, key_index: one fp16/bf16 dtype; got {[t.dtype for t in same.values()]}",
        LOW_PRECISION_INPUTS,
    )
    _rule(weights.dtype in (*LOW_PRECISION, torch.float32), f"weights must be fp16/bf16/fp32, got {weights.dtype}")
    _rule(query_rope is not None and key_rope is not None, "the absorbed-MLA form needs query_rope and key_rope")
    batch, s1, heads, dim = query.shape
    s2 = key.shape[1]
    idx_heads, idx_dim = query_index.shape[2], query_index.shape[3]
    _rule(heads in (32, 64, 128) and dim == 512, f"query: N1 in 32, 64, 128 and D 512; got {tuple(query.shape)}")
    _rule(key.shape == (batch, s2, 1, 512), f"key: [B, S2, 1, 512], got {tuple(key.shape)}")
    _rule(query_rope.shape == (batch, s1, heads, 64) and key_rope.shape == (batch, s2, 1, 64), "rope D 64")
    _rule(idx_heads in (8, 16, 32, 64) and query_index.shape[:2] == (batch, s1), f"query_index {query_index.shape}")
    _rule(key_index.shape == (batch, s2, 1, idx_dim), f"key_index: [B, S2, 1, D], got {tuple(key_index.shape)}")
    _rule(weights.shape == (batch, s1, idx_heads), f"weights: [B, S1, Nidx1], got {tuple(weights.shape)}")
    for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _rule(stat.dtype == torch.float32 and stat.shape == (batch, 1, s1, heads), f"{name}: fp32 [B, 1, S1, N1]")
    valid = _check_sparse_indices(sparse_indices, batch, s1, s2)
    width = sparse_indices.shape[3]
    _rule(width % 1024 == 0 and width <= 8192, f"sparse_indices K: a multiple of 1024 up to 8192, got {width}")
    idx = sparse_indices[:, :, 0].long().clamp(min=0)
    valid = valid & (idx <= _causal_limit(s1, s2, query.device))
    with torch.no_grad():
        q = torch.cat((query, query_rope), dim=-1).float()
        scores = _listed(torch.einsum("bsnd,btd->bsnt", q, torch.cat((key, key_rope), dim=-1)[:, :, 0].float()), idx)
        probs = torch.exp(scores * scale_value - softmax_max[:, 0].unsqueeze(-1)) / softmax_sum[:, 0].unsqueeze(-1)
        target = probs.masked_fill(~valid.unsqueeze(2), 0.0).sum(2)
        target = target / target.sum(-1, keepdim=True)
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_() for t in (query_index, key_index, weights)]
        qi, ki, w = leaves
        every = (torch.einsum("bshd,btd->bsht", qi, ki[:, :, 0]).relu() * w.unsqueeze(-1)).sum(2)  # [B, S1, S2]
        index = every.gather(-1, idx)
        log_index = torch.log_softmax(index.masked_fill(~valid, float("-inf")), dim=-1)
        kl = torch.xlogy(target, target) - torch.where(valid, target * log_index, 0.0)
        loss = kl.sum()
        grads = torch.autograd.grad(loss, leaves)
    d_qi, d_ki, d_w = (g.to(t.dtype) for g, t in zip(grads, (query_index, key_index, weights), strict=True))
    return d_qi, d_ki, d_w, loss.detach().reshape(1)


CALLS: list[str] = []


def module() -> types.ModuleType:
    """A ``torch_npu`` module holding the stand-ins; its CALLS starts empty."""
    CALLS.clear()
    fake = types.ModuleType("torch_npu")
    fake.__doc__ = __doc__
    for fn in (npu_rms_norm, npu_lightning_indexer, npu_sparse_flash_attention,
               npu_sparse_lightning_indexer_grad_kl_loss):  # fmt: skip
        setattr(fake, fn.__name__, fn)
    fake.CALLS = CALLS
    return fake


# --- torch_npu's device runtime, as vllm-ascend's import path and verl's weight sync touch it ------------------------
# tests_npu/support/vllm_cpu.py runs vLLM + vllm-ascend on the CPU over these. No NPU is visible there: what that code
# only names (classes in annotations, functions it stores) exists and refuses to run; what it calls answers as
# torch_npu does in a process that imports it and sees no device, or as rank 0 of a single-device job.

ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 2, 29  # the acl_format codes vllm-ascend passes


class NoNpuHere(RuntimeError):
    """A torch_npu device facility ran: it needs an NPU, and none is visible here."""


def refusing(qualified: str):
    def refused(*args, **kwargs):
        raise NoNpuHere(f"{qualified} needs an NPU; none is visible on this host (tests_npu/support/fake_torch_npu.py)")

    refused.__name__ = refused.__qualname__ = qualified.rsplit(".", 1)[-1]
    return refused


def refusing_class(qualified: str) -> type:
    return type(qualified.rsplit(".", 1)[-1], (), {"__init__": refusing(qualified)})


def npu_format_cast(self, acl_format, *, customize_dtype=None, input_dtype=None):
    """Stands in for ``torch_npu.npu_format_cast(self, acl_format) -> Tensor``.

    A format cast changes how the NPU lays a tensor out in its memory (ND row-major, FRACTAL_NZ 16x16 tiles); its
    shape and values, all a caller reads, stay ``self``'s, and a tensor already in that format comes back as is, which
    is what the stand-in returns for any. Covered: plain casts to ND, or to FRACTAL_NZ of a >= 2-D tensor (the casts
    vllm-ascend makes of unquantized weights); the dtype-changing forms are not.
    """
    CALLS.append("npu_format_cast")
    _rule(customize_dtype is None and input_dtype is None, "the stand-in covers casts without customize/input dtype")
    _rule(acl_format in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ), f"acl_format: ND or FRACTAL_NZ, not {acl_format}")
    _rule(acl_format == ACL_FORMAT_ND or self.dim() >= 2, f"FRACTAL_NZ tiles 2-D data, got {self.dim()}-D")
    return self


def device_runtime() -> types.ModuleType:
    """``torch_npu.npu``, which torch_npu also sets as ``torch.npu``, in a process without a visible NPU."""
    npu = types.ModuleType("torch_npu.npu")
    npu.is_available = lambda: False  # torch_npu imports, no device is visible
    # the device index vllm-ascend's process groups record (GroupCoordinator.device): rank 0's, of one device
    npu.current_device = lambda: 0
    npu.synchronize = lambda device=None: None  # nothing was queued on a device (verl syncs around weight buckets)
    npu.empty_cache = lambda: None  # nor cached on one
    # classes vllm-ascend names in annotations and dataclass fields at import (streams, events, ACL graphs)
    for name in ("Stream", "Event", "ExternalEvent", "NPUGraph"):
        setattr(npu, name, refusing_class(f"torch.npu.{name}"))
    # functions vllm-ascend's torch.accelerator patch stores
    for name in ("memory_stats", "memory_reserved", "reset_peak_memory_stats"):
        setattr(npu, name, refusing(f"torch.npu.{name}"))
    memory = types.ModuleType("torch_npu.npu.memory")
    # the return annotation of vllm-ascend's sleep-mode allocator factory
    memory.NPUPluggableAllocator = refusing_class("torch.npu.memory.NPUPluggableAllocator")
    npu.memory = memory
    return npu


def compiled_namespace() -> types.ModuleType:
    """``torch_npu._C`` as far as vllm-ascend reaches into it: names only, and HCCL's process-group options."""
    compiled = types.ModuleType("torch_npu._C")
    compiled._NPUTaskGroupHandle = refusing_class("torch_npu._C._NPUTaskGroupHandle")  # ACL graph annotations
    c10d = types.ModuleType("torch_npu._C._distributed_c10d")
    # vllm-ascend builds one per process group and sets its hccl_config; the groups here are gloo's, which take none
    c10d.ProcessGroupHCCL = type("ProcessGroupHCCL", (), {"Options": type("Options", (), {})})
    compiled._distributed_c10d = c10d
    return compiled


def install_runtime() -> types.ModuleType:
    """Make ``import torch_npu`` and ``torch.npu`` give the stand-ins, as importing torch_npu does on a node.

    For a fresh interpreter only: torch's private-use device takes the name ``npu`` (torch_npu's backend
    registration), which cannot be undone in that process.
    """
    import importlib.machinery
    import sys

    fake = module()
    fake.npu_format_cast = npu_format_cast
    fake.npu, fake._C = device_runtime(), compiled_namespace()
    modules = {"torch_npu": fake, "torch_npu.npu": fake.npu, "torch_npu.npu.memory": fake.npu.memory,
               "torch_npu._C": fake._C, "torch_npu._C._distributed_c10d": fake._C._distributed_c10d}  # fmt: skip
    for name, value in modules.items():
        value.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() answers, as for an installed one
        sys.modules[name] = value
    fake.__path__ = []
    torch.npu = fake.npu
    torch.distributed.is_hccl_available = lambda: False  # torch_npu adds it; no HCCL here (process groups are gloo's)
    torch.utils.rename_privateuse1_backend("npu")
    return fake
