"""vLLM 0.23.0 with vllm-ascend (the pinned release) executed on the CPU: the rollout side of verl's weight sync.

Test-process side: :func:`sources` unpacks vLLM's and vllm-ascend's Python from their PyPI sdists (the shared download
cache of tests_npu/support/pypi.py) and installs the packages their imports need (``IMPORT_REQUIREMENTS``) into a
cached directory; :func:`launch` / :func:`collect` run a request in a fresh interpreter. At import, vLLM and
vllm-ascend patch torch, register custom ops, rename torch's private-use device and read and set environment
variables: the test process never imports them.

Rollout side (``python -m support.vllm_cpu REQUEST.json``), in the order an Ascend rollout worker runs it:

1. the stand-ins for what cannot exist here (below), then the request's environment (e.g. the GLM-5.2 example's
   ``VERL_VLLM_ASCEND_GLM52_PATCH``);
2. vLLM picks its platform from the installed plugins: vllm-ascend's ``NPUPlatform`` (its ``vllm_ascend.egg-info``
   entry point, as ``pip install`` registers it); vLLM's general plugins load (vllm-ascend's platform patches);
3. verl's worker extension is imported (``vLLMColocateWorkerExtension``; the import applies verl's NPU patches to
   vLLM and, under ``VERL_VLLM_ASCEND_GLM52_PATCH``, to vllm-ascend), and the environment it sets for vllm-ascend
   (``VLLM_ASCEND_REQUIRED_ENV_VARS``, which it sets where ``torch.npu.is_available()``: not here) is set;
4. what vllm-ascend's ``NPUWorker.__init__`` does before loading a model: its worker patches (``adapt_patch``,
   among them ``patch_deepseek_v2``), dummy fusion ops, its custom-op layers (``register_ascend_customop``: linear
   layers, norms, embeddings, MLA, fused MoE), its config, and dropping unquantized linear layers from vLLM's
   ``WEIGHT_LOADER_V2_SUPPORTED``; then its distributed setup (vLLM's groups with vllm-ascend's group patch, its own
   model-parallel groups), on one rank;
5. per case: vLLM's model loader builds the model with ``load_format="dummy"`` (verl's default) and runs
   ``process_weights_after_loading`` (vllm-ascend's, as at rollout start); every parameter and every weight the
   attention derived from ``kv_b_proj`` is set to NaN; the case's export goes through verl's weight sync
   (``BucketedWeightSender`` -> ``vLLMColocateWorkerExtension.update_weights_from_ipc``: ``load_weights`` per bucket,
   then ``process_weights_after_loading`` once) as many times as the case says; the weights are written out;
6. the reference: vLLM's loader over the checkpoint itself (``load_format="auto"``), vLLM's own completeness check
   included.

What stands in, each because it cannot exist on this host:

* torch_npu (compiled, needs CANN): ``support.fake_torch_npu.install_runtime`` (its operators and device runtime);
  CANN's ``acl`` (pyACL, compiled): ``acl.rt.memcpy`` for vllm-ascend's sleep-mode allocator, refusing if called;
* ``vllm_ascend/_build_info.py``, which vllm-ascend's build writes from ``SOC_VERSION`` and the sdist lacks: A3's;
* NPU memory: vLLM allocates on ``current_platform.device_type``, redirected to ``cpu``; HCCL: gloo process groups;
* NPU IPC: verl's shared-memory transport, which it takes where NPU IPC is unsupported (it would ask ``npu-smi``);
* vLLM's model-class inspection in a fresh interpreter (kept there so CUDA stays uninitialised; that interpreter would
  not have the stand-ins) runs in this process instead;
* the worker itself: a namespace holding the model and config where vllm-ascend's ``NPUModelRunner`` would (all
  verl's extension reads of it), with the sync's socket named per sync instead of from a Ray job id.

Not run here: vllm-ascend's ATB extension registration and device checks (compiled, hardware), sleep mode (NPU
memory pools), a forward pass (its operators are NPU kernels).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from support import pypi
from support.paths import REPO, TESTS

# GLM-5.2's published config (examples/glm5_2/config.json) at small sizes, the model the vLLM runs build: layers 0-2
# dense, 3-7 MoE (4 experts, top-2), the published indexer and MLP layer kinds
SCALED_LAYERS = 8
PUBLISHED_GLM5_2 = json.loads((REPO / "examples" / "glm5_2" / "config.json").read_text())
SCALED_GLM5_2 = {
    **{k: v for k, v in PUBLISHED_GLM5_2.items() if k not in ("architectures", "torch_dtype", "use_cache")},
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 48,
    "num_hidden_layers": SCALED_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "index_n_heads": 2, "index_topk": 32,
    "max_position_embeddings": 128, "indexer_types": PUBLISHED_GLM5_2["indexer_types"][:SCALED_LAYERS],
    "mlp_layer_types": PUBLISHED_GLM5_2["mlp_layer_types"][:SCALED_LAYERS],
}  # fmt: skip

# Packages vLLM 0.23.0, vllm-ascend 0.23.0 and verl's rollout modules import (at module level) that the dev venv does
# not have, each pinned; installed without their dependencies beside (never into) the venv, whose packages come first.
# Versions: `uv pip compile` of vLLM's and vllm-ascend's requirements for them, constrained by the venv's packages
# (numpy overridden: mistral-common declares numpy<2.4, the venv has 2.5; the parts of it loaded here import and run).
IMPORT_REQUIREMENTS = (
    "apache-tvm-ffi==0.1.15.post2",  # xgrammar's runtime
    "cachetools==8.0.2",
    "cbor2==6.3.0",
    "compressed-tensors==0.17.0",
    "fastapi==0.123.10",  # vllm-ascend: <0.124
    "gguf==0.19.0",
    "httpx2==2.16.2",  # openai's HTTP client
    "ijson==3.6.0",
    "llguidance==1.7.6",  # vLLM: <1.8
    "loguru==0.7.3",
    "mistral-common==1.13.1",
    "msgspec==0.23.0",
    "openai==3.57.0",
    "openai-harmony==0.0.8",
    "partial-json-parser==0.2.1.1.post7",
    "py-cpuinfo==9.0.0",
    "pybase64==1.5.1",
    "pycountry==26.2.16",
    "pydantic-extra-types==2.11.1",
    "pyzmq==27.3.0",  # also verl's weight-sync transport
    "scipy==1.18.1",  # vllm-ascend
    "starlette==0.50.0",
    "tiktoken==0.14.0",
    "uvicorn==0.54.0",  # verl's rollout utilities
    "uvloop==0.23.0",
    "xgrammar==0.2.9",
)


@dataclass(frozen=True)
class Sources:
    """Where the rollout side's Python comes from: two unpacked sdists and the import requirements."""

    vllm: Path
    vllm_ascend: Path
    packages: Path


def releases() -> tuple[str, str]:
    """(vLLM, vllm-ascend) releases of the pinned stack: vLLM's tag, the vllm-ascend release of the pinned commit."""
    from verl_npu.stack import load_stack

    stack = load_stack()
    return stack.git["vllm"].version, pypi.RELEASE_OF_COMMIT[stack.git["vllm-ascend"].commit]


def _once(target: Path, make) -> Path:
    """``target``, made by ``make(tmp)`` into a sibling temporary directory and renamed: a half-made one never shows."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make(tmp)
        tmp.rename(target)
    except OSError:
        if not target.is_dir():  # not another process having made it meanwhile
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _unpacked(project: str, version: str, cache: Path) -> Path:
    """The sdist's package and its egg-info (version and entry points, as an installed copy has them)."""
    archive = pypi.sdist(project, version, cache)
    package = project.replace("-", "_")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]

    def make(tmp: Path) -> None:
        for inner in (package, f"{package}.egg-info"):
            pypi.extract(archive, inner, tmp)

    return _once(cache / "unpacked" / f"{archive.name.removesuffix('.tar.gz')}-{digest}", make)


def _installed_requirements(cache: Path) -> Path:
    interpreter = (sys.version, sys.platform, platform.machine())
    key = hashlib.sha256("\n".join((*interpreter, *IMPORT_REQUIREMENTS)).encode()).hexdigest()[:16]

    def make(tmp: Path) -> None:
        command = [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", sys.executable,
                   "--target", str(tmp), "--no-deps", "--only-binary", ":all:", *IMPORT_REQUIREMENTS]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"uv could not install vLLM's import requirements:\n{done.stderr[-4000:]}")

    return _once(cache / f"vllm-import-requirements-{key}", make)


def sources(cache: Path | None = None) -> Sources:
    """The pinned vLLM and vllm-ascend Python, and their import requirements (downloaded once, then cached)."""
    cache = pypi.cache_dir() if cache is None else cache
    vllm, vllm_ascend = releases()
    return Sources(
        vllm=_unpacked("vllm", vllm, cache),
        vllm_ascend=_unpacked("vllm-ascend", vllm_ascend, cache),
        packages=_installed_requirements(cache),
    )


def launch(source: Sources, request: dict, workdir: Path) -> subprocess.Popen:
    """Start the rollout side on ``request``; its output goes to ``workdir``.

    ``request``: ``checkpoint`` (an HF directory), ``env`` (set before anything is imported), ``bucket_megabytes``
    (verl's ``update_weights_bucket_megabytes``), ``cases`` (each a ``name``, an ``export`` file holding the
    ``[(name, tensor)]`` list to send, as ``torch.save`` wrote it, and how many ``syncs``) and ``reference``
    (also load the checkpoint with vLLM's loader). :func:`collect` gives the result: per case the error a sync
    raised (its chain, innermost first, and the name being loaded), every ``load_weights`` call's (name, dtype)
    list and a file of the weights after the syncs; the reference's weights; the model's module classes.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    request = {**request, "out": str(workdir), "packages": str(source.packages)}
    (workdir / "request.json").write_text(json.dumps(request, indent=2))
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}  # verl-npu's training layer
    # vLLM's and vllm-ascend's sources come before anything installed (PYTHONPATH precedes site-packages)
    env.update(PYTHONPATH=os.pathsep.join(map(str, (TESTS, source.vllm, source.vllm_ascend))),
               VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")  # fmt: skip
    with (workdir / "rollout.log").open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "support.vllm_cpu", str(workdir / "request.json")],
                                cwd=TESTS, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


class RolloutFailed(RuntimeError):
    """The rollout side did not finish (not a case's error: those are in its result)."""


def collect(process: subprocess.Popen, workdir: Path, timeout: float = 600) -> dict:
    """The rollout side's result (``result.json``), once it exits."""
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = "killed after a timeout"
    log = (workdir / "rollout.log").read_text(errors="replace")
    result = workdir / "result.json"
    if code != 0 or not result.is_file():
        raise RolloutFailed(f"vLLM rollout process: exit {code}, last output:\n{log[-8000:]}")
    return json.loads(result.read_text())


# --- the rollout side: runs in its own interpreter --------------------------------------------------------------------


def _install_stand_ins() -> None:
    import types

    from support import fake_torch_npu

    fake_torch_npu.install_runtime()
    acl, rt = types.ModuleType("acl"), types.ModuleType("acl.rt")
    rt.memcpy = fake_torch_npu.refusing("acl.rt.memcpy")  # CANN's runtime copy, for sleep mode's host backups
    acl.rt, acl.__path__ = rt, []
    build_info = types.ModuleType("vllm_ascend._build_info")
    build_info.__device_type__ = "A3"  # what vllm-ascend's build writes for SOC_VERSION ascend910_9392 (the A3 image)
    sys.modules.update({"acl": acl, "acl.rt": rt, "vllm_ascend._build_info": build_info})


def _vllm_config(checkpoint: str, load_format: str):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=checkpoint, dtype="bfloat16", max_model_len=128, enforce_eager=True,
                        skip_tokenizer_init=True, seed=0)  # fmt: skip
    return VllmConfig(
        model_config=model, load_config=LoadConfig(load_format=load_format), device_config=DeviceConfig("cpu")
    )


def _start_worker(vllm_config) -> None:
    """vllm-ascend's NPUWorker.__init__ and its distributed setup, the steps that shape the model and its loading."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.layers import linear
    from vllm_ascend import ops
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel
    from vllm_ascend.utils import adapt_patch, register_ascend_customop

    adapt_patch()
    ops.register_dummy_fusion_op()
    register_ascend_customop(vllm_config)
    init_ascend_config(vllm_config)
    if "UnquantizedLinearMethod" in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.WEIGHT_LOADER_V2_SUPPORTED.remove("UnquantizedLinearMethod")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1, 1, 1)
        init_ascend_model_parallel(vllm_config.parallel_config)


def _model(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(vllm_config):
        return get_model(vllm_config=vllm_config)


def _derived(model) -> dict:
    """The weights the attention derives from ``kv_b_proj`` in process_weights_after_loading (absorbed K and V)."""
    import torch

    found = {}
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        for attr in ("W_UK_T", "W_UV"):
            if isinstance(getattr(impl, attr, None), torch.Tensor):
                found[f"{name}.impl.{attr}"] = getattr(impl, attr)
    return found


def _classes(model) -> dict[str, str]:
    """Each module's class, and each attention implementation's (``<module>.impl``)."""
    named = {name: type(module) for name, module in model.named_modules()}
    named.update({f"{name}.impl": type(m.impl) for name, m in model.named_modules() if hasattr(m, "impl")})
    return {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in named.items()}


def _weights(model) -> dict:
    return {**dict(model.named_parameters()), **_derived(model)}


def _poison(model) -> None:
    import torch

    with torch.no_grad():
        for tensor in _weights(model).values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))


def _save(model, path: Path) -> str:
    import torch

    torch.save({name: tensor.detach().clone() for name, tensor in _weights(model).items()}, path)
    return str(path)


def _error(exc: BaseException) -> dict:
    """The exception and the ones it was raised while handling, innermost (the cause) first, with the traceback."""
    import traceback

    chain, seen = [], exc
    while seen is not None:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return {"chain": chain[::-1], "traceback": "".join(traceback.format_exception(exc))}


def _recording(load_weights, calls: list, loading: list):
    """``model.load_weights`` recording each call's (name, dtype) list and the name it is loading (``loading[0]``)."""

    def recorded(weights):
        weights = list(weights)
        calls.append([(name, str(tensor.dtype).removeprefix("torch.")) for name, tensor in weights])

        def handed():
            for name, tensor in weights:
                loading[0] = name
                yield name, tensor

        return load_weights(handed())

    return recorded


def _sync(worker, export, bucket_megabytes: int, handle: str) -> None:
    """One weight sync as verl runs it: the trainer side's sender against the worker's update_weights_from_ipc."""
    import asyncio
    import threading

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    def send() -> None:
        try:
            sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_megabytes, use_shm=True)
            asyncio.run(sender.async_send_weights(iter(export)))
        except BaseException:
            if not worker.failed:  # the trainer side broke: nothing to report per case, the run is void
                import traceback

                traceback.print_exc()
                os._exit(3)

    worker.handle, worker.failed = handle, False
    threading.Thread(target=send, daemon=True).start()
    try:
        worker.update_weights_from_ipc(peft_config=None, base_sync_done=True, use_shm=True)
    except BaseException:
        worker.failed = True  # the sender is left waiting for an answer (a daemon thread)
        raise


def _rollout(request: dict) -> dict:
    """Steps 1-6 of the module docstring; returns what ``result.json`` records."""
    import torch

    _install_stand_ins()
    os.environ.update(request["env"])
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    current_platform.device_type = "cpu"
    registry._run_in_subprocess = lambda inspect: inspect()
    load_general_plugins()
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer, utils

    os.environ.update({k: v for k, v in utils.VLLM_ASCEND_REQUIRED_ENV_VARS.items() if k not in os.environ})
    bucketed_weight_transfer.is_support_ipc = lambda: False

    class RolloutWorker(utils.vLLMColocateWorkerExtension):
        """verl's worker extension over the model, as vLLM mixes it into vllm-ascend's NPUWorker."""

        def __init__(self, model, vllm_config):
            from types import SimpleNamespace

            self.model_runner = SimpleNamespace(model=model, vllm_config=vllm_config)
            self.device, self.local_rank = torch.device("cpu"), 0

        def _get_zmq_handle(self) -> str:
            return self.handle

    first = _vllm_config(request["checkpoint"], "dummy")
    _start_worker(first)
    out, sockets = Path(request["out"]), Path(tempfile.mkdtemp(prefix="vllm-sync-"))  # short: socket paths
    result = {"platform": type(current_platform).__name__, "cases": {}}
    for number, case in enumerate(request["cases"]):
        vllm_config = first if number == 0 else _vllm_config(request["checkpoint"], "dummy")
        model = _model(vllm_config)
        if number == 0:
            result["modules"] = _classes(model)
            result["model_bases"] = [f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__]
        worker = RolloutWorker.__new__(RolloutWorker, vllm_config=vllm_config)
        worker.__init__(model, vllm_config)
        calls, loading = [], [None]
        model.load_weights = _recording(model.load_weights, calls, loading)
        export = torch.load(case["export"])
        entry = {"error": None, "load_weights_calls": calls}
        try:
            for sync in range(case["syncs"]):
                _poison(model)
                _sync(worker, export, request["bucket_megabytes"], f"ipc://{sockets}/{case['name']}-{sync}.sock")
        except Exception as exc:  # the case's outcome (a broken export must fail here)
            entry["error"] = {**_error(exc), "loading": loading[0]}
        entry["weights"] = _save(model, out / f"{case['name']}.pt")
        result["cases"][case["name"]] = entry
    if request["reference"]:
        result["reference"] = {"weights": _save(_model(_vllm_config(request["checkpoint"], "auto")), out / "ref.pt")}
    shutil.rmtree(sockets, ignore_errors=True)
    return result


def main(argv: list[str]) -> int:
    import site

    request = json.loads(Path(argv[0]).read_text())
    site.addsitedir(request["packages"])  # their import requirements, after the venv's packages
    result = _rollout(request)
    (Path(request["out"]) / "result.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    os._exit(0)  # a sender left waiting on a socket (a failed case) must not hold the interpreter's exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
