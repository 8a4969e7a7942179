"""The wheel folder a device call carries to run bench/rl_step.py on the nvidia-h200 machine (issue 31, item 4).

That machine has no internet and its image holds torch 2.11, triton, transformers 5.17 and the packages listed in
``IMAGE`` (as last read on it, 2026-11-17): no megatron-core, mbridge, verl, omegaconf, codetiming or tensordict, no
Ray, datasets or wandb. What the benchmark needs beyond the image is found, not guessed: a process imports
everything the benchmark's engine processes import, with verl's driver stack stood in for as it is there
(verl_npu/testing/verl_without_driver.py), and every distribution a module came from is listed; ``--from-run``
adds the distributions a finished run's engine processes recorded (bench/rl_step.py writes them into its JSON:
imports made while running, not only at import). The image's distributions are left out, except transformers,
which is carried at this venv's version (5.10.4, the stack the CPU check ran; the image's 5.17 is untested), with
the tokenizers it accepts.

Then ``.whl/`` gets, for each: ``pip download --no-deps`` of the venv's version as a CPython 3.12 manylinux x86-64
wheel; for one published only as source (antlr4-python3-runtime), ``pip wheel --no-deps`` builds it here; mbridge
is packed from the venv's installed files with its dist-info (verl-npu's install patches it; the RECORD is
written again for the patched files). The total must stay under 60 MiB (64 MiB travel per call, the repository
included). It prints each wheel's size and the device command line.

    python bench/rl_step_carry.py [--from-run bench/results/rl_step_dense_cpu.json ...] [--out .whl]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 60 << 20
PYTHON_VERSION = "3.12"  # the device image's python3 (3.12.3)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
# carried at the venv's version (module docstring); transformers 5.10.4 checks at import for tokenizers<=0.23.0,
# and the image has 0.23.2
CARRIED_DESPITE_THE_IMAGE = ("transformers", "tokenizers")
FROM_INSTALLED_FILES = ("mbridge",)  # patched in the venv by verl-npu's install: its files, not PyPI's
OURS = ("verl-npu",)  # the repository itself travels with the call
# the device image's Python distributions (2026-11-17), normalised names
IMAGE = frozenset(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "botorch",
        "build",
        "certifi",
        "charset-normalizer",
        "chex",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "coverage",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "cupy-cuda13x",
        "cycler",
        "cython",
        "diffrax",
        "e3nn",
        "einops",
        "equinox",
        "etils",
        "execnet",
        "filelock",
        "flatbuffers",
        "flax",
        "fonttools",
        "formulaic",
        "frozenlist",
        "fsspec",
        "gpytorch",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "humanize",
        "hypothesis",
        "idna",
        "imageio",
        "iniconfig",
        "interface-meta",
        "jax",
        "jax-cuda13-pjrt",
        "jax-cuda13-plugin",
        "jaxlib",
        "jaxtyping",
        "jinja2",
        "joblib",
        "kiwisolver",
        "lazy-loader",
        "lightning",
        "lightning-utilities",
        "linear-operator",
        "lineax",
        "llvmlite",
        "lxml",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "meson",
        "ml-dtypes",
        "mpi4py",
        "mpmath",
        "msgpack",
        "multidict",
        "multipledispatch",
        "mypy-extensions",
        "nanobind",
        "narwhals",
        "networkx",
        "ninja",
        "numba",
        "numba-cuda",
        "numpy",
        "numpyro",
        "nvidia-cublas",
        "nvidia-cuda-cupti",
        "nvidia-cuda-nvrtc",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
        "nvidia-cufft",
        "nvidia-cufile",
        "nvidia-curand",
        "nvidia-cusolver",
        "nvidia-cusparse",
        "nvidia-cusparselt-cu13",
        "nvidia-ml-py",
        "nvidia-nccl-cu13",
        "nvidia-nvjitlink",
        "nvidia-nvshmem-cu13",
        "nvidia-nvtx",
        "onnx",
        "onnx-ir",
        "onnxruntime",
        "onnxscript",
        "opencv-python-headless",
        "optax",
        "opt-einsum",
        "opt-einsum-fx",
        "optimistix",
        "orbax-checkpoint",
        "packaging",
        "pandas",
        "pathspec",
        "patsy",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "portalocker",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "pybind11",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pyproject-hooks",
        "pyre-extensions",
        "pytest",
        "pytest-benchmark",
        "pytest-cov",
        "pytest-mock",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pytorch-lightning",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "sacrebleu",
        "safetensors",
        "scikit-build-core",
        "scikit-image",
        "scikit-learn",
        "scipy",
        "seaborn",
        "sentencepiece",
        "sentence-transformers",
        "setuptools",
        "shellingham",
        "simplejson",
        "six",
        "sortedcontainers",
        "statsmodels",
        "sympy",
        "tabulate",
        "tensorboard",
        "tensorboard-data-server",
        "tensorstore",
        "threadpoolctl",
        "tifffile",
        "tiktoken",
        "timm",
        "tokenizers",
        "toolz",
        "torch",
        "torchaudio",
        "torchdiffeq",
        "torch-geometric",
        "torchmetrics",
        "torchvision",
        "tqdm",
        "transformers",
        "treescope",
        "triton",
        "typer",
        "typing-extensions",
        "typing-inspect",
        "urllib3",
        "uvloop",
        "wadler-lindig",
        "werkzeug",
        "wheel",
        "wrapt",
        "xarray",
        "xxhash",
        "yarl",
        "zipp",
    ]
)

# everything the benchmark's engine processes import (bench/rl_step.py: _setup, run_engine), in a process where
# verl's driver stack is stood in for as on the device
PROBE = textwrap.dedent(
    """
    import json, os
    os.environ["VERL_NPU_ALLOW_MISMATCH"] = "1"
    import verl_npu.megatron_adaptor as layer
    layer.load()
    from verl_npu.testing import cpu_megatron, verl_without_driver as loader
    loader.import_engine(absent=loader.DRIVER_STACK)  # first, as bench/rl_step.py does: megatron's try of wandb
    cpu_megatron.activate()
    import verl_npu.engine.verl_engine, verl_npu.engine.bridges.glm5, verl_npu.parity.job
    import verl.trainer.config, verl.workers.config, verl.workers.utils.losses, verl.protocol
    import verl.utils.tensordict_utils, verl.workers.utils.padding, verl.utils.checkpoint.megatron_checkpoint_manager
    import megatron.core.dist_checkpointing, megatron.core.optimizer, safetensors.torch, rich.table
    import rl_step, rl_step_models
    print(json.dumps(rl_step.loaded_distributions()))
    """
)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(from_runs: list[Path]) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), str(REPO / "bench"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the import probe failed:\n{done.stderr[-4000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for path in from_runs:
        run = json.loads(path.read_text())
        for engine in run["engines"].values():
            found |= engine.get("distributions", {})
    return {normalise(name): version for name, version in found.items()}


def to_carry(found: dict[str, str]) -> dict[str, str]:
    """Those the device lacks (or that are carried at the venv's version anyway), without the repository itself."""
    return {
        name: version for name, version in sorted(found.items())
        if name not in OURS and (name not in IMAGE or name in CARRIED_DESPITE_THE_IMAGE)
    }  # fmt: skip


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600, check=False
    )


def download(name: str, version: str, out: Path) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    done = _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                "--implementation", "cp", *platforms, "-d", str(out), f"{name}=={version}")  # fmt: skip
    if done.returncode == 0:
        return
    built = _pip("wheel", "--no-deps", "-w", str(out), f"{name}=={version}")  # published as source only
    if built.returncode != 0:
        raise SystemExit(f"{name}=={version}: no wheel to download ({done.stderr.strip()[-800:]}) and none built "
                         f"({built.stderr.strip()[-800:]})")  # fmt: skip


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_from_installed(name: str, out: Path) -> Path:
    """A py3 wheel of an installed distribution's files as they are (patched ones included), RECORD rewritten."""
    dist = importlib.metadata.distribution(name)
    files = [f for f in dist.files or [] if not str(f).endswith((".pyc", "RECORD", "INSTALLER", "direct_url.json"))
             and "__pycache__" not in str(f)]  # fmt: skip
    info = next(str(f).split("/")[0] for f in files if str(f).split("/")[0].endswith(".dist-info"))
    path = out / f"{normalise(name).replace('-', '_')}-{dist.version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for file in files:
            data = Path(dist.locate_file(file)).read_bytes()
            wheel.writestr(str(file), data)
            records.append(f"{file},{_record_hash(data)},{len(data)}")
        if f"{info}/WHEEL" not in {str(f) for f in files}:
            wheel_text = "Wheel-Version: 1.0\nGenerator: verl-npu bench/rl_step_carry.py\nRoot-Is-Purelib: true\n"
            wheel_text += "Tag: py3-none-any\n"
            wheel.writestr(f"{info}/WHEEL", wheel_text)
            records.append(f"{info}/WHEEL,{_record_hash(wheel_text.encode())},{len(wheel_text)}")
        wheel.writestr(f"{info}/RECORD", "\n".join([*records, f"{info}/RECORD,,"]) + "\n")
    return path


def build(out: Path, from_runs: list[Path]) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob("*.whl"))
    if stale:
        raise SystemExit(f"{out} already holds {len(stale)} wheels: remove them first (two versions of one package "
                         "stop the device's install)")  # fmt: skip
    for name, version in to_carry(imported_distributions(from_runs)).items():
        if name in FROM_INSTALLED_FILES:
            wheel_from_installed(name, out)
        else:
            download(name, version, out)
    sizes = {wheel.name: wheel.stat().st_size for wheel in sorted(out.glob("*.whl"))}
    total = sum(sizes.values())
    if total > LIMIT:
        raise SystemExit(f"{out}: {total / 2**20:.1f} MiB of wheels, over the {LIMIT >> 20} MiB a device call may "
                         "carry besides the repository")  # fmt: skip
    return sizes


def device_command(out: Path, model: str = "dense") -> str:
    install = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
               f"/tmp/site {out.name}/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;")  # fmt: skip
    run = (f"PYTHONUNBUFFERED=1 python3 bench/rl_step.py --model {model} --work /tmp/rl_step "
           f"--out $OUT/rl_step_{model}_h200.json 2>&1 | tee $OUT/rl_step_{model}.log")  # fmt: skip
    return f"{install} set -o pipefail; {run}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=REPO / ".whl", help="the folder (ignored by git: .git/info/exclude)"
    )
    parser.add_argument("--from-run", type=Path, action="append", default=[], help="a bench/rl_step.py JSON")
    args = parser.parse_args(argv)
    sizes = build(args.out, args.from_run)
    width = max(map(len, sizes))
    for name, size in sizes.items():
        print(f"{name:<{width}}  {size / 2**20:7.2f} MiB")
    print(f"{'total':<{width}}  {sum(sizes.values()) / 2**20:7.2f} MiB (limit {LIMIT >> 20} MiB)")
    print(f"\nrun(carry=[{args.out.name!r}], command=)\n{device_command(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
