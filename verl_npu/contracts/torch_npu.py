"""What verl-npu relies on in torch-npu (the version pinned in verl_npu/stack/stack.toml).

The operator schemas are the ones torch-npu registers (its native-functions YAML); the limits come
from the documentation it ships for each operator. tests_npu/support/fake_torch_npu.py stands in for
these operators with exactly these signatures (a CPU test compares them), and verl_npu/ops/ascend.py
calls them.
"""

from __future__ import annotations

from verl_npu.contracts.spec import Contract, Expect

_SCHEMAS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
_DOCS = "torch_npu/_op_plugin_docs.py"

# npu_lightning_indexer's sparse_count: 1..2048, then multiples of 1024 up to 8192.
INDEXER_SPARSE_COUNTS = (*range(1, 2049), *range(3072, 8193, 1024))

SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> "
    "(Tensor, Tensor)",
    "npu_lightning_indexer": "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, Tensor? "
    "actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str "
    'layout_query="BSND", str layout_key="BSND", int sparse_count=2048, int sparse_mode=3, int '
    "pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, "
    "Tensor)",
    "npu_sparse_flash_attention": "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor "
    "sparse_indices, float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, Tensor? "
    "actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, int sparse_block_size=1, str "
    'layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, int pre_tokens=9223372036854775807, int '
    "next_tokens=9223372036854775807, int attention_mode=0, bool return_softmax_lse=False) -> (Tensor, Tensor, "
    "Tensor)",
    "npu_sparse_lightning_indexer_grad_kl_loss": "npu_sparse_lightning_indexer_grad_kl_loss(Tensor query, Tensor "
    "key, Tensor query_index, Tensor key_index, Tensor weights, Tensor sparse_indices, Tensor softmax_max, Tensor "
    "softmax_sum, float scale_value, *, Tensor? query_rope=None, Tensor? key_rope=None, SymInt[]? "
    "actual_seq_qlen=None, SymInt[]? actual_seq_klen=None, str? layout='BSND', int? sparse_mode=3, int? "
    "pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807) -> (Tensor, Tensor, Tensor, Tensor)",
}

# sha256 and line of each schema in torch-npu 2.10.0.post4
_SCHEMA_FINGERPRINTS = {
    "npu_rms_norm": ("763ea93e398be330842e758343f24206fff726967f1c18c1b10ac4fc5641662d", 733),
    "npu_rms_norm_backward": ("82994e418aff764f93aa35fa80a9af9f6f5c8f8e1078ba291d909d49dcd448e0", 737),
    "npu_lightning_indexer": ("cd919d7666b0a5edd9317e4106e730f224d683772fca596b518f0ec9fadb7e68", 492),
    "npu_sparse_flash_attention": ("81330648b5fb2e41dafcf0ea7fb2968e3d505385479a93e41e4eca27df4671d5", 977),
    "npu_sparse_lightning_indexer_grad_kl_loss": (
        "29f6cfc1ed6608a5043e8bbc5dc0785b36b027c053e651cf72a12c7ecdfb0ac1",
        987,
    ),
}

_USED_BY = "verl_npu/ops/ascend.py (calls it), tests_npu/support/fake_torch_npu.py (its stand-in's signature)"

CONTRACTS = (
    *(
        Contract(
            id=f"torch-npu-schema-{op.replace('_', '-')}",
            component="torch-npu",
            path=_SCHEMAS,
            locator="schema",
            symbol=op,
            line=_SCHEMA_FINGERPRINTS[op][1],
            sha256=_SCHEMA_FINGERPRINTS[op][0],
            relied_on=f"torch_npu.{op} has this signature: {schema}",
            used_by=_USED_BY,
            expects=(
                Expect(schema, "the whole signature"),
                Expect("sinks", "no attention-sink input in this version", present=False),
            ),
        )
        for op, schema in SCHEMAS.items()
    ),
    Contract(
        id="torch-npu-lightning-indexer-sparse-count",
        component="torch-npu",
        path=_DOCS,
        locator="op-doc",
        symbol="npu_lightning_indexer",
        line=1327,
        sha256="655363c1531bb15176c058bae8097629e1a436b5e2f8811261c3e69103d4ef57",
        relied_on="npu_lightning_indexer's sparse_count takes 1..2048 and 3072, 4096, ..., 8192; weights are "
        "[B, S1, N1]",
        used_by="verl_npu/ops/ascend.py, verl_npu/engine/build_plan.py (index_topk under the fused operators)",
        expects=(
            Expect("支持1-2048以及3072、4096、5120、6144、7168、8192", "the sparse_count values"),
            Expect("支持输入shape[B,S1,N1]、[T,N1]", "weights layout"),
        ),
    ),
    Contract(
        id="torch-npu-kl-loss-int-list-lengths",
        component="torch-npu",
        path=_DOCS,
        locator="op-doc",
        symbol="npu_sparse_lightning_indexer_grad_kl_loss",
        line=14574,
        sha256="2e7781371d24b0d170baeb4ffb8f19fdd3d6ff8208ec44d48443ed356ed4ae36",
        relied_on="npu_sparse_lightning_indexer_grad_kl_loss takes actual_seq_qlen / actual_seq_klen as int lists "
        "(TND only) and returns (d_query_index, d_key_index, d_weights, loss) without autograd",
        used_by=_USED_BY,
        expects=(
            # the documentation's full-width parentheses, written as escapes
            Expect("actual_seq_qlen\uff08int[]\uff09", "an int list, not a tensor"),
            Expect("d_query_index\uff08Tensor\uff09", "returns the indexer gradients"),
        ),
    ),
    Contract(
        id="torch-npu-host-allocator-cache",
        component="torch-npu",
        path="torch_npu/npu/memory.py",
        locator="python",
        symbol="host_empty_cache",
        line=183,
        sha256="d50ab66c626ee9a9c43890d63202694c863daadd6edf1074ea03285a4f0dfd58",
        relied_on="torch_npu.npu.host_empty_cache() returns the pinned host blocks its caching allocator keeps",
        used_by="verl_npu/engine/offload.py (close() gives the arenas' pinned memory back)",
        expects=(Expect("torch_npu._C._npu_hostEmptyCache()", "empties the pinned host cache"),),
    ),
)
