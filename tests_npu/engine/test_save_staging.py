"""The checkpoint save's device-to-host copies staged in idle host regions (verl_npu/engine/save_staging.py),
through megatron-core's own writer class."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core's checkpoint writer; not installed here")

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from verl_npu.engine import save_staging


def buckets(*tensors: torch.Tensor) -> list:
    """megatron's write buckets: (file name, storage key, (byte items, (item, tensor) pairs))."""
    return [("f0", "k0", ([("bytes-item", b"x")], [(f"item{i}", t) for i, t in enumerate(tensors)]))]


def inside(tensor: torch.Tensor, region: torch.Tensor) -> bool:
    start = region.data_ptr()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + region.nbytes


def test_each_tensor_lands_in_the_region_as_its_own_storage_with_its_values():
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    tensors = [torch.randn(7, 3), torch.arange(5, dtype=torch.int64), torch.randn(4, dtype=torch.float64)]
    with save_staging.staged_in([region]) as stats:
        ((_, _, (byte_items, staged)),) = FileSystemWriterAsync.preload_tensors(buckets(*tensors), True)
    assert byte_items == [("bytes-item", b"x")]
    for (item, out), (expected_item, source) in zip(staged, buckets(*tensors)[0][2][1], strict=True):
        assert item == expected_item and out.dtype == source.dtype and torch.equal(out, source)
        assert inside(out, region) and out.data_ptr() % 512 == 0
        assert out.untyped_storage().nbytes() == source.nbytes  # the writer saves whole storages: only these bytes
    assert (stats.staged_tensors, stats.staged_bytes) == (3, sum(t.nbytes for t in tensors))
    assert (stats.megatron_tensors, stats.megatron_bytes) == (0, 0)


def test_what_does_not_fit_or_is_strided_goes_megatrons_way_and_the_patch_is_undone():
    original = FileSystemWriterAsync.__dict__["preload_tensors"]
    region = torch.zeros(1024, dtype=torch.uint8)
    big, strided, small = torch.randn(512), torch.randn(8, 8).t(), torch.randn(16)
    with save_staging.staged_in([region]) as stats:
        ((_, _, (_, staged)),) = FileSystemWriterAsync.preload_tensors(buckets(big, strided, small), True)
    outs = [out for _, out in staged]
    assert [torch.equal(o, s) for o, s in zip(outs, (big, strided, small), strict=True)] == [True] * 3
    assert [inside(o, region) for o in outs] == [False, False, True]
    assert (stats.staged_tensors, stats.megatron_tensors, stats.megatron_bytes) == (1, 2, big.nbytes + strided.nbytes)
    assert FileSystemWriterAsync.__dict__["preload_tensors"] is original
    with pytest.raises(ValueError, match="in the save"), save_staging.staged_in([region]):
        raise ValueError("in the save")
    assert FileSystemWriterAsync.__dict__["preload_tensors"] is original


def test_no_region_changes_nothing_and_saves_do_not_nest():
    original = FileSystemWriterAsync.__dict__["preload_tensors"]
    with save_staging.staged_in([]) as stats:
        assert FileSystemWriterAsync.__dict__["preload_tensors"] is original
    assert stats.staged_tensors == 0
    region = torch.zeros(1024, dtype=torch.uint8)
    with save_staging.staged_in([region]):
        assert FileSystemWriterAsync.__dict__["preload_tensors"] is not original
        with pytest.raises(RuntimeError, match="do not nest"), save_staging.staged_in([region]):
            pass
    assert FileSystemWriterAsync.__dict__["preload_tensors"] is original


def test_a_drifted_megatron_preload_is_refused_naming_what_was_expected(monkeypatch):
    monkeypatch.setattr(FileSystemWriterAsync, "preload_tensors", staticmethod(lambda buckets: buckets))
    expected = r"expected a staticmethod\('write_buckets', 'non_blocking'\).*\('buckets',\)"
    with pytest.raises(RuntimeError, match=expected), save_staging.staged_in([torch.zeros(8, dtype=torch.uint8)]):
        pass
