"""The engine's HF checkpoint load (verl_npu/engine/bridges/fast_read.py, fast_load.py): the bytes safetensors
gives, every malformed header refused by name, and a model loaded bit-identically to mbridge 0.15.1's loader.

GLM-5's load (its experts, FP8 dequantised as the loader does it) is checked against the checkpoint's own values in
tests_npu/engine/test_glm5_2_bridge.py; bench/rl_step.py checks both engines' exports against the checkpoint on the
device.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("mbridge", reason="the bridges' loader; not installed here")

from safetensors import safe_open
from safetensors.torch import save_file
from test_glm5_bridge import cpu_engine, gpt_of, no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401

from verl_npu.engine.bridges import fast_export, fast_load, fast_read


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bool": torch.rand(7, generator=g) > 0.5,  # 7 bytes: what follows is misaligned unless padded
        "b.bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "c.f32": torch.randn(11, generator=g),
        "d.fp8": torch.randn(4, 9, generator=g).to(torch.float8_e4m3fn),
        "e.i64": torch.randint(-(2**40), 2**40, (3, 2), generator=g),
        "f.u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "g.f16": torch.randn(2, 2, 2, generator=g).half(),
        "h.empty": torch.zeros(0, 4),
    }


def test_read_tensors_gives_safetensors_bytes_for_every_dtype_in_parallel_chunks(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    save_file(every_dtype(), str(path))
    monkeypatch.setattr(fast_read, "CHUNK_BYTES", 5)  # dozens of chunks, across tensor boundaries
    with safe_open(str(path), framework="pt") as f:
        expected = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    for threads in (1, 4):
        for names in (list(expected), ["c.f32", "e.i64"], ["h.empty"]):
            got = fast_read.read_tensors(path, names, threads=threads)
            assert list(got) == names
            for name in names:
                want = expected[name]
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
                assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), (name, threads)


def _file(tmp_path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "message"),
    [
        ({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 3, None, r"'w' .* spans bytes"),
        ({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"its shape needs 6 bytes"),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, None, r"'w' has dtype 'Q4'"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"'w' has shape \[-1\]"),
        ({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, r"'w' has no dtype, shape and data_offsets"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, 1 << 40, r"header of \d+ bytes"),
        ([1, 2], b"", None, r"not a JSON object"),
    ],
    ids=["past-the-end", "shape-vs-span", "dtype", "shape", "keys", "header-length", "not-an-object"],
)
def test_a_malformed_file_is_refused_naming_it_and_the_tensor(tmp_path, header, data, length, message):
    path = _file(tmp_path, header, data, length)
    with pytest.raises(fast_read.CheckpointFileError, match=message) as caught:
        fast_read.read_tensors(path, [])
    assert str(path) in str(caught.value)


def test_a_name_the_file_lacks_and_a_truncated_file_are_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    with pytest.raises(fast_read.CheckpointFileError, match=r"no tensor \['v'\]"):
        fast_read.read_tensors(path, ["v"])
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(fast_read.CheckpointFileError, match="spans bytes"):
        fast_read.read_tensors(path, ["w"])


def test_the_loader_maps_every_dtype_the_header_check_knows_to_a_torch_dtype_of_its_size():
    from verl_npu import safetensors_header

    assert fast_read.DTYPES.keys() == safetensors_header.DTYPE_SIZES.keys()
    assert all(fast_read.DTYPES[name].itemsize == size for name, size in safetensors_header.DTYPE_SIZES.items())


def recording_reads(monkeypatch) -> list[tuple[str, int, int]]:
    """(file name, offset, bytes) of every ``os.preadv`` from now on."""
    reads = []
    real_preadv = os.preadv

    def recording_preadv(fd, buffers, offset):
        reads.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, sum(len(b) for b in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    return reads


def bytes_read(reads: list[tuple[str, int, int]]) -> collections.Counter:
    """How often each (file name, byte offset) was read."""
    return collections.Counter((file, byte) for file, offset, n in reads for byte in range(offset, offset + n))


def tensor_bytes(path: Path, names: list[str] | None = None) -> set[tuple[str, int]]:
    entries, start = fast_read.read_header(path)
    return {
        (path.name, start + byte)
        for name, entry in entries.items()
        if names is None or name in names
        for byte in range(*entry["offsets"])
    }


@pytest.fixture
def node_rank_zero(monkeypatch):
    """The process that prefetches for its node, with plenty of memory available."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(fast_read, "_available_bytes", lambda: 1 << 30)


def two_files(tmp_path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tensors = {"w": torch.randn(1000, generator=g), "v": torch.randn(300, generator=g), "u": torch.arange(50)}
    save_file({"w": tensors["w"], "v": tensors["v"]}, str(tmp_path / "m.safetensors"))
    save_file({"u": tensors["u"]}, str(tmp_path / "n.safetensors"))
    return tensors


@pytest.mark.usefixtures("node_rank_zero")
def test_a_load_claims_the_prefetched_reads_so_the_disk_reads_no_byte_twice(tmp_path, monkeypatch):
    from mbridge.core.safetensor_io import SafeTensorIO

    tensors = two_files(tmp_path)
    reads = recording_reads(monkeypatch)
    prefetch = fast_read.prefetch(tmp_path)
    try:
        assert prefetch.nbytes == sum(t.nbytes for t in tensors.values())
        with fast_read.TensorReads(SafeTensorIO(str(tmp_path)), ["u", "w", "v"]) as loaded:
            for name in ("u", "w", "v"):
                assert torch.equal(loaded.take(name), tensors[name]), name
        assert prefetch.claimed_bytes == prefetch.nbytes
    finally:
        prefetch.close()
    counts = bytes_read(reads)
    assert set(counts) == tensor_bytes(tmp_path / "m.safetensors") | tensor_bytes(tmp_path / "n.safetensors")
    assert set(counts.values()) == {1}  # every tensor byte once: the load read nothing itself
    assert not fast_read._PREFETCHES  # closed: forgotten

    reads.clear()  # a load after the close reads for itself
    with fast_read.TensorReads(SafeTensorIO(str(tmp_path)), ["w"]) as loaded:
        assert torch.equal(loaded.take("w"), tensors["w"])
    assert set(bytes_read(reads)) == tensor_bytes(tmp_path / "m.safetensors", ["w"])


@pytest.mark.usefixtures("node_rank_zero")
def test_a_file_that_changed_since_the_prefetch_is_read_again(tmp_path, caplog):
    from mbridge.core.safetensor_io import SafeTensorIO

    two_files(tmp_path)
    prefetch = fast_read.prefetch(tmp_path)
    try:
        newer = {"w": torch.full((1000,), 7.0), "v": torch.full((300,), -1.0)}  # same layout, other values
        save_file(newer, str(tmp_path / "m.safetensors"))
        stat = (tmp_path / "m.safetensors").stat()
        os.utime(tmp_path / "m.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        reader = SafeTensorIO(str(tmp_path))
        with caplog.at_level("WARNING", logger=fast_read.__name__), fast_read.TensorReads(reader, ["w", "u"]) as loaded:
            assert torch.equal(loaded.take("w"), newer["w"]) and torch.equal(loaded.take("u"), torch.arange(50))
        assert "m.safetensors changed since it was prefetched" in caplog.text
        assert prefetch.claimed_bytes == 50 * 8  # only n.safetensors' u
    finally:
        prefetch.close()


def test_the_prefetch_runs_on_one_process_per_node_and_only_within_the_memory_share(tmp_path, monkeypatch, caplog):
    two_files(tmp_path)
    monkeypatch.setattr(fast_read, "_available_bytes", lambda: 1 << 30)
    monkeypatch.setenv("LOCAL_RANK", "3")  # another rank of the node: rank 0's reads warm the shared page cache
    assert fast_read.prefetch(tmp_path) is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(fast_read, "_available_bytes", lambda: 10_000)  # 10 kB * 0.5 < the tensors' 5.6 kB
    assert fast_read.prefetch(tmp_path) is None
    monkeypatch.setattr(fast_read, "_available_bytes", lambda: 1 << 30)
    (tmp_path / "n.safetensors").write_bytes(b"\x01")  # the load reports the file by name; no prefetch
    with caplog.at_level("INFO", logger=fast_read.__name__):
        assert fast_read.prefetch(tmp_path) is None
    assert "n.safetensors: 1 bytes, shorter than a safetensors header length" in caplog.text
    for index in ([1, 2], {"weight_map": {"w": 3}}):  # nor with an index that names no files
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with caplog.at_level("INFO", logger=fast_read.__name__):
            assert fast_read.prefetch(tmp_path) is None
        assert "model.safetensors.index.json: no weight_map object of tensor name -> file name" in caplog.text


@pytest.mark.usefixtures("node_rank_zero")
def test_the_prefetch_reads_the_indexed_tensors_but_those_of_layers_the_model_does_not_build(tmp_path, monkeypatch):
    from types import SimpleNamespace

    layers = {f"model.layers.{i}.{w}": torch.full((300,), float(i)) for i in range(4) for w in ("a.weight", "b.weight")}
    save_file({**layers, "model.embed_tokens.weight": torch.ones(200)}, str(tmp_path / "m.safetensors"))
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "stale.safetensors"))  # no index entry names it
    index = {"weight_map": {name: "m.safetensors" for name in [*layers, "model.embed_tokens.weight"]}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reads = recording_reads(monkeypatch)
    # two decoder layers and one MTP layer trained: layer 3 (a second MTP layer) is not built
    skip = fast_read.unloaded_layers(SimpleNamespace(num_hidden_layers=2, num_nextn_predict_layers=1))
    assert [skip(n) for n in ("model.layers.2.a.weight", "model.layers.3.a.weight", "lm_head.weight")] == [
        False, True, False,
    ]  # fmt: skip
    prefetch = fast_read.prefetch(tmp_path, skip)
    prefetch.close()  # cancels what has not started
    prefetch._pool.shutdown(wait=True)  # the reads in flight end
    wanted = [name for name in index["weight_map"] if not skip(name)]
    assert prefetch.nbytes == sum(300 * 4 for n in wanted if "layers" in n) + 200 * 4
    assert set(bytes_read(reads)) <= tensor_bytes(tmp_path / "m.safetensors", wanted)  # neither layer 3 nor stale


def test_device_copies_run_ahead_within_their_room_and_never_hold_up_the_load(tmp_path, monkeypatch):
    from mbridge.core.safetensor_io import SafeTensorIO

    tensors = {f"t{i}": torch.full((100 + i,), float(i)) for i in range(12)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(fast_read, "COPY_AHEAD_BYTES", 900)  # two tensors of ~400 bytes at a time
    reader = SafeTensorIO(str(tmp_path))
    order = list(tensors)
    outcome = {}

    def load(names: list[str], uses: dict[str, int]) -> None:
        with fast_read.TensorReads(reader, order, uses, torch.device("cpu")) as loaded:
            outcome["values"] = [(name, loaded.take(name)) for name in names]

    # in load order; then out of order and a tensor taken twice (tied embeddings): never a wait on room
    # that only a later take would free
    for names, uses in ((order, {}), ([*reversed(order), "t0"], {"t0": 2})):
        outcome.clear()
        worker = threading.Thread(target=load, args=(names, uses), daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), f"the load hung taking {names}"
        assert [name for name, _ in outcome["values"]] == names
        assert all(torch.equal(value, tensors[name]) for name, value in outcome["values"])


# --- a model through the bridge ---------------------------------------------------------------------------------
TINY_QWEN2 = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, torch_dtype="bfloat16",
)  # fmt: skip


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A tiny Qwen2 saved in shards with an index (the reads span files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, max_shard_size="40KB")
    vocab = {f"t{i}": i for i in range(TINY_QWEN2["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1").save_pretrained(path)
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 2
    return path


@pytest.mark.usefixtures("cpu_megatron_harness", "node_rank_zero")
def test_the_engine_loads_a_dense_model_bit_identically_to_mbridges_loader(dense_dir, monkeypatch):
    from mbridge.core.bridge import Bridge

    closed = []  # the engine's prefetch, as its load left it
    close = fast_read.Prefetch.close
    monkeypatch.setattr(fast_read.Prefetch, "close", lambda p: closed.append((p.claimed_bytes, p.nbytes)) or close(p))
    engine = cpu_engine(dense_dir)
    files = sorted(dense_dir.glob("*.safetensors"))
    assert closed == [(sum(len(tensor_bytes(f)) for f in files),) * 2]  # every byte the load read was prefetched
    bridge = engine.bridge
    assert bridge.load_weights.func is fast_load.load_weights  # what the engine bound, and loaded with
    assert bridge.export_weights.func is fast_export.export_weights  # and what it streams to the rollout with
    gpt = gpt_of(engine)
    ours = {name: t.detach().clone() for name, t in gpt.state_dict().items() if "_extra_state" not in name}
    with torch.no_grad():
        for p in gpt.parameters():
            p.zero_()
    Bridge.load_weights(bridge, engine.module, str(dense_dir))  # mbridge 0.15.1's own loader
    theirs = {name: t for name, t in gpt.state_dict().items() if "_extra_state" not in name}
    assert ours.keys() == theirs.keys()
    differing = [n for n in ours if not torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8))]
    assert not differing
    assert any(t.abs().sum() > 0 for t in theirs.values())


def test_a_bridge_with_a_loader_of_its_own_keeps_it():
    from mbridge.core.bridge import Bridge

    class OwnLoader(Bridge):
        def __init__(self):  # no config needed to decide
            pass

        def load_weights(self, models, weights_path, memory_efficient=False):
            return "its own"

    bridge = OwnLoader()
    assert not fast_load.bind_to(bridge)
    assert bridge.load_weights([], "") == "its own"


@pytest.mark.parametrize(
    ("layout", "whole"),
    [
        ({}, True),
        ({"get_pipeline_model_parallel_world_size": 2}, False),  # a stage's layers only
        ({"get_expert_model_parallel_world_size": 4}, False),  # its EP rank's experts only
        ({"get_tensor_model_parallel_rank": 1}, False),  # TP rank 0 reads and scatters
        ({"get_expert_tensor_parallel_rank": 1}, False),
    ],
)
def test_the_engine_prefetches_only_where_the_process_loads_the_whole_checkpoint(monkeypatch, layout, whole):
    from megatron.core import parallel_state as mpu

    from verl_npu.engine.verl_engine import loads_whole_checkpoint

    single = {
        "get_pipeline_model_parallel_world_size": 1, "get_expert_model_parallel_world_size": 1,
        "get_tensor_model_parallel_rank": 0, "get_expert_tensor_parallel_rank": 0,
    }  # fmt: skip
    for name, value in {**single, **layout}.items():
        monkeypatch.setattr(mpu, name, lambda value=value: value)
    assert loads_whole_checkpoint() is whole


def test_tensor_reads_give_each_tensor_as_stored_as_often_as_it_is_taken(tmp_path):
    from mbridge.core.safetensor_io import SafeTensorIO

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(4).to(torch.bfloat16)}
    save_file({"a": tensors["a"], "b": tensors["b"]}, str(tmp_path / "one.safetensors"))
    save_file({"c": tensors["c"]}, str(tmp_path / "two.safetensors"))
    reader = SafeTensorIO(str(tmp_path))
    with fast_read.TensorReads(reader, ["c", "a", "b"], uses={"a": 2}) as reads:
        assert reads.nbytes == sum(t.nbytes for t in tensors.values())
        for name in ("c", "a", "a", "b"):
            got = reads.take(name)
            assert got.dtype == tensors[name].dtype and torch.equal(got, tensors[name]), name
        assert "a" not in reads and "b" not in reads  # taken as often as asked: let go
        with pytest.raises(KeyError):
            reads.take("a")
    with pytest.raises(ValueError, match=r"Weights \['z'\] not found"):
        fast_read.TensorReads(reader, ["a", "z"])
