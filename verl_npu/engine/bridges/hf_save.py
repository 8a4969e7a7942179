"""Saving an HF checkpoint from a bridge whose export holds fewer tensors than the checkpoint it loaded.

mbridge 0.15.1's ``SafeTensorIO.save_hf_weight`` lays the saved checkpoint out as the loaded one's index says, and
writes a shard only once every tensor that index lists for it has been exported; what is left over is a warning.
Three sources of a GLM-5 checkpoint's names are never exported:

- an FP8 release's ``*_scale_inv`` block scales (the bridge dequantises on load and exports bf16);
- the MTP layer (RL does not train it: verl_npu.engine.bridges.glm5);
- GLM-5.2's shared layers' indexer, where a checkpoint has one.

Any shard holding one of them was never written, and the saved index still listed it, so ``load_checkpoint`` of
that HF checkpoint failed, or found weights missing. Here each shard of the loaded layout is written with the
exported tensors it holds, as soon as it has all it will get (at the latest when the export ends). A tensor the
loaded index does not list goes to a shard of its own, and the saved index lists exactly what was written. Each
file is written under a temporary name and renamed, so a failed save leaves no partial shard.

Remove when mbridge's saver writes what the export yields (its ``save_hf_weight`` as of mbridge 0.15.1).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

from verl_npu.engine.bridges.fp8_safetensors import SCALE_SUFFIX

EXTRA_SHARD = "model-extra.safetensors"  # exported tensors the loaded index does not list


def _save_shard(tensors: dict[str, torch.Tensor], path: str) -> None:
    partial = f"{path}.partial"
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, partial, metadata={"format": "pt"})
    os.replace(partial, path)


class SavesWhatIsExported:
    """Mixin for an mbridge ``SafeTensorIO``: its save writes every exported tensor and an index of exactly them."""

    _saved: dict[str, str] | None = None  # exported name -> the shard it was written to (a save with an index)
    _saved_bytes = 0  # their tensors' bytes (the index's total_size, as HF counts it)

    def save_hf_weight(self, per_tensor_generator: Iterable, new_hf_dir: str, hf_shared_weight_keys: list[str]):
        if not self.index:  # one file for everything, as mbridge writes it
            return super().save_hf_weight(per_tensor_generator, new_hf_dir, hf_shared_weight_keys)
        expected: dict[str, set[str]] = defaultdict(set)  # shard -> the exportable names the loaded index lists
        for name, filename in self.index.items():
            if not name.endswith(SCALE_SUFFIX):
                expected[filename].add(name)
        pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        saved: dict[str, str] = {}
        self._saved_bytes = 0
        for name, tensor in per_tensor_generator:
            filename = self.index.get(name, EXTRA_SHARD)
            if name in saved or name in pending[filename]:
                raise RuntimeError(f"the export yielded {name!r} twice: one of the two would be lost")
            pending[filename][name] = tensor.detach().cpu()
            self._saved_bytes += tensor.numel() * tensor.element_size()
            # every pending name of a listed shard is one of its expected names: equal counts mean it is whole
            if filename != EXTRA_SHARD and len(pending[filename]) == len(expected[filename]):
                _save_shard(pending.pop(filename), os.path.join(new_hf_dir, filename))
                saved.update(dict.fromkeys(expected[filename], filename))
        for filename, tensors in pending.items():  # shards some of whose tensors are never exported
            if tensors:
                _save_shard(tensors, os.path.join(new_hf_dir, filename))
                saved.update(dict.fromkeys(tensors, filename))
        self._saved = saved

    def save_hf_weight_memory_efficient(self, per_tensor_generator: Iterable, new_hf_dir: str):
        # mbridge's version writes each tensor to a file of its own, then merges the index's shards, reading back
        # names the export never wrote; this one holds no more than the shards still incomplete
        return self.save_hf_weight(per_tensor_generator, new_hf_dir, [])

    def save_index(self, new_hf_dir: str):
        if self._saved is None:
            return super().save_index(new_hf_dir)
        index = {"metadata": {"total_size": self._saved_bytes}, "weight_map": dict(sorted(self._saved.items()))}
        partial = os.path.join(new_hf_dir, "model.safetensors.index.json.partial")
        with open(partial, "w") as f:
            json.dump(index, f, indent=2)
        os.replace(partial, os.path.join(new_hf_dir, "model.safetensors.index.json"))
