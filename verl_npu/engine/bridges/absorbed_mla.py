"""HF ``kv_b_proj`` <-> MindSpeed's absorbed-MLA ``linear_k_up_proj`` + ``linear_v_up_proj``.

With ``use_dsa_absorb`` MindSpeed builds MLA with separate K and V up projections from the latent
(contract mindspeed-absorbed-attention-parameters), each read head-major: ``K.view(heads,
qk_head_dim, kv_lora_rank)`` and ``V.view(heads, v_head_dim, kv_lora_rank)`` (contracts
mindspeed-absorbed-{k,v}-rows-per-head). HF's ``kv_b_proj`` holds both interleaved per head: for each
head its qk_head_dim K rows, then its v_head_dim V rows. Splitting it in two halves by rows would
give every head of K the wrong rows whenever there is more than one head.
"""

from __future__ import annotations

import torch


def split_kv_b_proj(kv_b: torch.Tensor, heads: int, qk_head_dim: int, v_head_dim: int):
    """HF kv_b_proj [heads * (qk + v), latent] -> (K [heads * qk, latent], V [heads * v, latent])."""
    rows = qk_head_dim + v_head_dim
    if kv_b.dim() != 2 or kv_b.shape[0] != heads * rows:
        raise ValueError(
            f"kv_b_proj of shape {tuple(kv_b.shape)}: expected [{heads} heads x ({qk_head_dim} K + {v_head_dim} V) "
            f"rows, latent]"
        )
    k, v = kv_b.view(heads, rows, -1).split([qk_head_dim, v_head_dim], dim=1)
    return k.reshape(heads * qk_head_dim, -1).contiguous(), v.reshape(heads * v_head_dim, -1).contiguous()


def merge_kv_b_proj(k_up: torch.Tensor, v_up: torch.Tensor, heads: int, qk_head_dim: int, v_head_dim: int):
    """(K [heads * qk, latent], V [heads * v, latent]) -> HF kv_b_proj [heads * (qk + v), latent]."""
    if k_up.shape[0] != heads * qk_head_dim or v_up.shape[0] != heads * v_head_dim or k_up.shape[1] != v_up.shape[1]:
        raise ValueError(
            f"linear_k_up_proj {tuple(k_up.shape)} / linear_v_up_proj {tuple(v_up.shape)}: expected "
            f"[{heads}x{qk_head_dim}, latent] and [{heads}x{v_head_dim}, latent]"
        )
    k = k_up.view(heads, qk_head_dim, -1)
    v = v_up.view(heads, v_head_dim, -1)
    return torch.cat([k, v], dim=1).reshape(heads * (qk_head_dim + v_head_dim), -1)
