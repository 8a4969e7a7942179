"""The Ascend software stack on the CPU, for the ``ascend_sim`` tier: MindSpeed's real Python over megatron-core.

What runs for real: megatron-core 0.18 (as installed), MindSpeed at the pinned commit (its features list, patch
manager, ``repatch``, layer specs, absorbed MLA, fused DSA forward, kv-allgather CP wrapper), and verl-npu's own
engine code. What stands in, and why (each is absent here, not merely inconvenient):

* torch_npu's compiled operators: ``support.fake_torch_npu`` (same signatures, input rules, fp32 results). One
  documented rule is recorded instead of enforced here: the operators' "no non-contiguous inputs". MindSpeed hands
  ``npu_sparse_flash_attention`` split views (its query's and key's latent part); whether the aclnn entry makes them
  contiguous or the kernel refuses them only a node can tell (tests_npu/stack/test_ascend_stack_npu.py runs that path),
  so every such input is listed in ``fake_torch_npu.RECORDED`` for the test to name.
  torch_npu's module surface that MindSpeed touches at import (``__file__``, ``__version__``, dtype names,
  ``torch_npu.npu`` device helpers) is given CPU answers below, each line saying what it answers for.
* torchair (shipped inside torch_npu; MindSpeed's op builders register graph-engine converters with it at import):
  a module whose converter registration records and returns the function unchanged; no graph engine exists here.
* MegatronAdaptor (``megatron_adaptor``, gitcode only): MindSpeed's package ``__init__`` imports it for its device
  patches; here ``verl_npu.testing.cpu_megatron`` plays that part (megatron's CUDA calls redirected to the CPU).
* TransformerEngineNPU: megatron-core sees no TransformerEngine (as on a CPU dev box), so the models build on
  megatron's local modules: where megatron's experimental-attention block spec (the one the GLM-5 bridge builds on
  Ascend) asks for TE's spec provider, it gets megatron's local spec provider (same spec tree, local module
  classes); where MindSpeed's absorbed MLA accepts TE's duplicated ``TELinear`` for its down projections (as the
  TE spec gives it on Ascend), it gets verl-npu's ``DuplicatedLinear``, the module the local provider's
  ``linear()`` builds for the same role (verl_npu/runtime_patches/dsa_local_spec.py). MindSpeed's kv-allgather CP
  module imports two TE-NPU modules at its top; their names are provided, and every one raises if called (the CP
  attention itself needs CP > 1 ranks and NPU streams).

Megatron is imported before MindSpeed (on Ascend it is the other way round): MindSpeed's own patches create a dummy
``transformer_engine`` module for TE-only targets, and a megatron module imported after that would believe TE is
installed and ask for its version. Importing megatron first keeps every megatron module on its no-TE path, the path
this tier can execute.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import os
import pkgutil
import sys
import types
import warnings
from pathlib import Path

from support import fake_torch_npu

# The gitcode packages MindSpeed expects beside it, with what stands in for each here.
ABSENT_HERE = {
    "torch_npu": "tests_npu/support/fake_torch_npu.py (operators) + CPU answers for its module surface",
    "torchair": "a converter registry that keeps the functions it is given (no graph engine)",
    "megatron_adaptor": "verl_npu.testing.cpu_megatron (megatron's device calls redirected to the CPU)",
    "transformer_engine": "the two TE-NPU modules MindSpeed's kv-allgather CP imports, each name raising if called",
}


class StandInCalled(RuntimeError):
    """A stand-in for code that cannot exist here was executed (the path needs an Ascend node)."""


def _refuses(qualified: str):
    def refused(*args, **kwargs):
        raise StandInCalled(f"{qualified} needs an Ascend node (TransformerEngineNPU); the ascend_sim tier stands in")

    refused.__name__ = qualified.rsplit(".", 1)[-1]
    refused.__qualname__ = refused.__name__
    return refused


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() answers for it, as for a real one
    module.__dict__.update(attributes)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        module.__package__ = parent
        setattr(sys.modules[parent], child, module)
    return module


def _package(name: str, **attributes) -> types.ModuleType:
    module = _module(name, **attributes)
    module.__path__ = []  # a package: its submodules are the ones registered here
    return module


def _torch_npu() -> types.ModuleType:
    import torch

    fake = fake_torch_npu.module()
    fake_torch_npu.RECORDED = {fake_torch_npu.CONTIGUITY: []}
    fake.__file__ = str(Path(fake_torch_npu.__file__))  # MindSpeed's op builders read the package directory
    fake.__version__ = "2.10.0.post4"  # the manifest's pin (verl_npu/stack/stack.toml)
    fake.__path__ = []
    sys.modules["torch_npu"] = fake
    _package("torch_npu._C")
    # dtypes torch_npu adds to torch that MindSpeed names at import (fp8 recipes); never used on this path
    for name in ("float8_e8m0fnu", "hifloat8"):
        setattr(fake, name, getattr(torch, name, None))
    # what torch_npu's backend registration sets (torch_npu/_init/registry/backend.py in the pinned wheel)
    fake.unsupported_dtype = [torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8]
    # HCCL's process-group options (compiled): the CPU's gloo groups take none, so the class has no hccl_config and
    # MindSpeed's group-naming wrapper of megatron's get_nccl_options passes the options through unchanged
    hccl = type("ProcessGroupHCCL", (), {"Options": type("Options", (), {})})
    _module("torch_npu._C._distributed_c10d", ProcessGroupHCCL=hccl)
    npu = _package("torch_npu.npu")
    npu.is_available = lambda: False
    npu.device_count = lambda: 0
    return fake


def _torchair() -> types.ModuleType:
    registered: dict[object, object] = {}

    def register_fx_node_ge_converter(op):
        def keep(function):
            registered[op] = function
            return function

        return keep

    torchair = _package("torchair", register_fx_node_ge_converter=register_fx_node_ge_converter, CONVERTERS=registered)
    _module("torchair.ge", Tensor=type("Tensor", (), {}), TensorSpec=type("TensorSpec", (), {}),
            DataType=type("DataType", (), {}))  # fmt: skip
    return torchair


def _transformer_engine_npu() -> None:
    """TE-NPU's modules that MindSpeed's kv-allgather CP imports at module level (names only; calling them raises).

    Registered after every megatron module was imported (see the module docstring), so megatron keeps its no-TE
    path; MindSpeed's own dummies for TE-only patch targets attach under this package as they would under TE-NPU."""
    base = "transformer_engine.pytorch.attention.dot_product_attention"
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention", base):
        if name not in sys.modules:
            _package(name)
    imported = {
        f"{base}.kvallgather_context_parallel": (
            "get_seq_chunk_ids_for_reordering_before_attn",
            "get_cu_seqlens_qkv_before_attn",
        ),
        f"{base}.utils": ("get_distributed_rank", "get_distributed_world_size"),
    }
    for module, names in imported.items():
        if module not in sys.modules:
            _module(module, **{name: _refuses(f"{module}.{name}") for name in names})


def _te_spec_provider() -> None:
    """megatron's experimental-attention block spec names ``TESpecProvider`` (imported only where TE is): the local
    provider builds the same spec tree from megatron's own modules."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    if getattr(specs, "TESpecProvider", None) is None:
        specs.TESpecProvider = LocalSpecProvider


def install_stand_ins() -> None:
    """Put every stand-in in ``sys.modules`` (idempotent; megatron must be imported first)."""
    if "torch_npu" not in sys.modules:
        _torch_npu()
    if "torchair" not in sys.modules:
        _torchair()
    if "megatron_adaptor" not in sys.modules:
        _module("megatron_adaptor", __doc__=ABSENT_HERE["megatron_adaptor"])
    _transformer_engine_npu()
    _te_spec_provider()


def import_megatron_without_te() -> int:
    """Import every megatron.core module now, so each decides "no TransformerEngine" before MindSpeed runs."""
    import megatron.core

    count = 0
    for info in pkgutil.walk_packages(megatron.core.__path__, "megatron.core."):
        importlib.import_module(info.name)
        count += 1
    return count


def quiet() -> None:
    """MindSpeed's patch manager reads an attribute of every loaded module; transformers' deprecated image-processor
    aliases log a line for each: keep the logs to what matters."""
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _te_linear_in_absorbed_mla() -> None:
    """MindSpeed's absorbed MLA names TE's ``TELinear`` (megatron's placeholder class without TE): the duplicated
    linear stands in."""
    from megatron.core.extensions import transformer_engine as megatron_te
    from mindspeed.core.transformer.experimental_attention_variant import dsa_matrix_absorption

    from verl_npu.engine.modules import DuplicatedLinear

    if not megatron_te.HAVE_TE:
        dsa_matrix_absorption.TELinear = DuplicatedLinear


def activate(mindspeed_root: Path) -> types.ModuleType:
    """MindSpeed from ``mindspeed_root`` (the directory holding ``mindspeed/``), imported as the image imports it;
    returns ``mindspeed.megatron_adaptor``. Call once per process, before anything else imports MindSpeed."""
    quiet()
    sys.argv = sys.argv[:1]  # MindSpeed parses the process's arguments as its own at import
    import_megatron_without_te()
    install_stand_ins()
    sys.path.insert(0, str(mindspeed_root))
    adaptor = importlib.import_module("mindspeed.megatron_adaptor")
    _te_linear_in_absorbed_mla()
    return adaptor
