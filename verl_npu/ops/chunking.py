"""How much the chunked DSA backends hold per query chunk (torch-free, so preflight can read it).

Each bounds the elements of one chunk's score-sized working tensors; the ops size their query
chunks to it. Preflight's memory model (verl_npu.preflight.memory), which describes Ascend, counts
the attention and indexer top-k bounds; the KL loss's only matters when the indexer is trained
(dsa_indexer_loss_coeff > 0; verl-npu's GLM-5 bridge sets 0) and is not counted there.
"""

# DSA sparse attention, portable backend: a chunk's mask (CUDA's SDPA takes it fused) or, where SDPA
# may fall back to its math kernel, the chunk's per-head scores; 2**27 keeps a 32k-token chunk at
# 2048 query rows on CUDA (64 MiB mask)
DSA_ATTENTION_CHUNK_ELEMENTS = 2**27
# DSA indexer top-k: a chunk's [b, rows, index_heads, s] fp32 scores
DSA_INDEXER_CHUNK_ELEMENTS = 2**27
# DSA indexer KL loss: a chunk's fp32 scores over attention and indexer heads
DSA_INDEXER_LOSS_CHUNK_ELEMENTS = 2**26
