"""The input rules of Ascend's fused DSA operators (torch-npu 2.10.0.post4 and ops-transformer's tiling), without
torch: the operator adapters (verl_npu/ops/ascend.py) refuse inputs that break them before calling the kernel, and the
engine's build plan (verl_npu/engine/build_plan.py) refuses a model that would break them before it is built.
The facts behind them are contracts: verl_npu/contracts/torch_npu.py and verl_npu/contracts/mindspeed.py.
"""

from __future__ import annotations

from verl_npu.contracts.mindspeed import FUSED_KL_ATTENTION_HEADS
from verl_npu.contracts.torch_npu import INDEXER_SPARSE_COUNTS

# npu_lightning_indexer: the kernel's tiling refuses any other head dim, key head count, top-k range
INDEXER_HEAD_DIM = 128
# UNCONFIRMED for older torch_npu/CANN: op-plugin's torch_npu doc says "only 64", the kernel's
# tiling checks no head count and its newer README says <= 64 (GLM-5 has 32)
INDEXER_MAX_HEADS = 64
# sparse_count takes 1..2048, then multiples of 1024 up to 8192 (contract torch-npu-lightning-indexer-sparse-count)
INDEXER_SMALL_TOPK = 2048

# npu_sparse_flash_attention / npu_sparse_lightning_indexer_grad_kl_loss: absorbed MLA only, one latent key head
LATENT_DIM, ROPE_DIM = 512, 64
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # per device
# the KL-loss operator's Q_N is the TP-gathered attention head count (MindSpeed checks the same)
KL_QUERY_HEADS = FUSED_KL_ATTENTION_HEADS
KL_INDEXER_HEADS = (8, 16, 32, 64)
# its sparse_indices width: a multiple of 1024 up to 8192 (ops-transformer's KL-loss tiling)
KL_TOPK_STEP, KL_MAX_TOPK = 1024, 8192
# a top-k both the indexer (sparse_count) and the KL-loss operator take
FUSED_TOPK = tuple(k for k in range(KL_TOPK_STEP, KL_MAX_TOPK + 1, KL_TOPK_STEP) if k in INDEXER_SPARSE_COUNTS)
