"""The layer's load sequence, through real processes: verl loads it, order, errors, concurrency."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu import runtime_patches
from verl_npu.patching.docs import render_markdown

LAYER = "verl_npu.megatron_adaptor"


def python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 600):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_NPU_", "VERL_USE_EXTERNAL"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def test_import_verl_applies_the_layer_and_patches_json_lists_every_patch():
    code = (
        "import json, sys, verl\n"
        f"from {LAYER} import LAYER\n"
        "import verl.trainer.constants_ppo\n"
        "print(json.dumps(LAYER.to_dict()))\n"
    )
    done = python(code, env={"VERL_USE_EXTERNAL_MODULES": LAYER})
    assert done.returncode == 0, done.stderr[-3000:]
    layer = json.loads(done.stdout.strip().splitlines()[-1])
    statuses = {p["id"]: p["status"] for p in layer["patches"]}
    assert set(statuses) == {p.id for p in runtime_patches.ALL}
    assert statuses["ray-runtime-env-forwarding"] == "applied"  # its target was imported
    assert statuses["dsa-indexer-rotation"] == "pending"  # megatron was not: nothing imported eagerly

    cli = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "patches", "--json"], capture_output=True, text=True, check=False
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    listed = json.loads(cli.stdout)
    assert [p["id"] for p in listed["patches"]] == [p.id for p in runtime_patches.ALL]
    assert all(p["status"] in ("applied", "skipped") and p["detail"] for p in listed["patches"])


def test_without_the_variable_verl_does_not_load_the_layer():
    done = python(f"import sys, verl; print({LAYER!r} in sys.modules)")
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "False"


@pytest.fixture
def ascend_stand_ins(tmp_path: Path) -> Path:
    """Stand-ins for MegatronAdaptor, TransformerEngineNPU and MindSpeed that record their import."""
    (tmp_path / "import_log.py").write_text("ORDER = []\n")
    record = "import import_log, sys\nimport_log.ORDER.append((__name__, 'megatron.core' in sys.modules))\n"
    (tmp_path / "megatron_adaptor.py").write_text(record)
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text(record)
    (tmp_path / "mindspeed").mkdir()
    (tmp_path / "mindspeed" / "__init__.py").write_text("")
    # MindSpeed's module also holds the repatch that verl-npu's mindspeed-dsa-cp-config patch wraps
    (tmp_path / "mindspeed" / "megatron_adaptor.py").write_text(record + "def repatch(args):\n    return None\n")
    return tmp_path


def test_ascend_adaptors_load_in_order_before_megatron(ascend_stand_ins):
    code = f"import json, import_log, {LAYER}; print(json.dumps(import_log.ORDER))"
    # the stand-in's repatch is not MindSpeed's source: the patch that wraps it may only warn about that here
    env = {"VERL_NPU_PLATFORM": "ascend", "PYTHONPATH": str(ascend_stand_ins), "VERL_NPU_ALLOW_MISMATCH": "1"}
    done = python(code, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mindspeed-dsa-cp-config" in done.stderr  # the loud warning names the patch
    order = json.loads(done.stdout.strip().splitlines()[-1])
    assert order == [
        ["megatron_adaptor", False],
        ["transformer_engine", False],
        ["mindspeed.megatron_adaptor", False],
    ]


def test_megatron_imported_too_early_is_refused_with_the_load_order(ascend_stand_ins):
    # megatron.core probes an importable transformer_engine's metadata: keep the stand-in away.
    shutil.rmtree(ascend_stand_ins / "transformer_engine")
    code = f"import megatron.core, {LAYER}"
    done = python(code, env={"VERL_NPU_PLATFORM": "ascend", "PYTHONPATH": str(ascend_stand_ins)})
    assert done.returncode != 0
    assert "LoadOrderError: megatron.core was imported" in done.stderr
    assert "megatron_adaptor -> transformer_engine -> mindspeed.megatron_adaptor" in done.stderr


def test_a_missing_ascend_adaptor_is_named(tmp_path):
    done = python(f"import {LAYER}", env={"VERL_NPU_PLATFORM": "ascend", "PYTHONPATH": str(tmp_path)})
    assert done.returncode != 0
    assert "verl-npu: cannot import megatron_adaptor" in done.stderr and "verl-npu doctor" in done.stderr


@pytest.mark.parametrize(
    "failure",
    [
        "raise OSError('libhccl.so: cannot open shared object file')",
        "raise ImportError('libascendcl.so: cannot open shared object file')",
        "b'\\xff'.decode('utf-8')",  # seen when set_env.sh was not sourced
    ],
)
def test_a_torch_npu_that_cannot_load_on_a_node_with_npus_becomes_one_cann_error(tmp_path, failure):
    # Stands in for torch_npu without CANN: importing it fails the way the real one does.
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(failure + "\n")
    # This machine has no /dev/davinci*: the node's device files are stood in for.
    code = f"import verl_npu.platform as p; p.npu_device_files = lambda *a: ['/dev/davinci0']; import {LAYER}"
    done = python(code, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode != 0
    assert "CANNEnvironmentError: torch_npu is installed but failed to load" in done.stderr
    assert "/dev/davinci0" in done.stderr
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in done.stderr


def test_a_pod_without_npus_runs_the_driver_on_cpu_when_torch_npu_cannot_load(tmp_path):
    # A KubeRay head pod of the verl-npu image: torch_npu is installed, the host driver is not mounted.
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise ImportError('libascend_hal.so: cannot open')\n")
    code = f"import {LAYER} as layer; print('platform', layer.LAYER.platform)"
    done = python(code, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "platform cpu" in done.stdout
    assert "torch_npu cannot load here" in done.stderr and "no NPU device" in done.stderr


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    files = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__")]
            for name in filenames:
                path = os.path.join(dirpath, name)
                with_stat = os.stat(path)
                files[path] = (with_stat.st_mtime_ns, with_stat.st_size)
    return files


def test_sixteen_processes_load_the_layer_at_once_identically_and_write_nothing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    code = (
        "import json, verl\n"
        f"from {LAYER} import LAYER\n"
        "LAYER.import_patch_targets()\n"
        "print(json.dumps(LAYER.to_dict(), sort_keys=True))\n"
    )
    env = {
        "VERL_USE_EXTERNAL_MODULES": LAYER,
        "HOME": str(home),
        "TMPDIR": str(home),
        "PYTHONDONTWRITEBYTECODE": "1",  # the interpreter's own bytecode cache is not ours to judge
    }
    site = Path(sys.prefix)
    before = _snapshot(REPO / "verl_npu", site, home)
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda _: python(code, env=env, cwd=home, timeout=900), range(16)))
    for done in results:
        assert done.returncode == 0, done.stderr[-3000:]
    records = {done.stdout.strip().splitlines()[-1] for done in results}
    assert len(records) == 1, "processes disagree on what the layer applied"
    assert all(p["status"] in ("applied", "skipped") for p in json.loads(records.pop())["patches"])
    after = _snapshot(REPO / "verl_npu", site, home)
    assert after == before, f"files written: {sorted(set(after.items()) ^ set(before.items()))[:10]}"


def test_committed_patch_docs_are_generated_from_the_registry():
    committed = (REPO / "docs" / "patches.md").read_text()
    assert committed == render_markdown(runtime_patches.ALL), "docs/patches.md is stale: verl-npu patches --markdown"
    for patch in runtime_patches.ALL:
        assert patch.id in committed and patch.remove_when in committed


def _doctor_layer(env: dict[str, str], *flags: str) -> dict[str, dict]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_NPU_", "VERL_USE_EXTERNAL"))}
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "doctor", "--json", *flags],
        capture_output=True, text=True, env={**base, **env}, timeout=900, check=False,
    )  # fmt: skip
    report = json.loads(done.stdout)
    return {f["check"]: f for f in report["findings"] if f["check"].startswith("layer.")}


def test_doctor_reports_the_layer_active_in_a_process_and_in_a_ray_worker():
    findings = _doctor_layer({"VERL_USE_EXTERNAL_MODULES": LAYER})
    assert findings["layer.process"]["status"] == "ok", findings
    assert "active after `import verl`" in findings["layer.process"]["detail"]
    assert findings["layer.ray-worker"]["status"] == "ok", findings
    assert findings["layer.ray-worker"]["detail"] == "active in a Ray worker; runtime env forwards the layer"


def test_doctor_reports_a_missing_layer_with_the_fix():
    findings = _doctor_layer({}, "--no-ray")
    assert findings["layer.process"]["status"] == "warn"  # fail on Ascend targets
    assert findings["layer.process"]["fix"] == f"export VERL_USE_EXTERNAL_MODULES={LAYER}"
    assert findings["layer.ray-worker"]["detail"] == "not checked (Ray not installed or --no-ray)"


def test_patches_cli_reports_a_layer_that_cannot_load_without_a_traceback():
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_NPU_", "VERL_USE_EXTERNAL"))}
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "patches"],
        capture_output=True, text=True, env={**base, "VERL_NPU_TARGET": "a3"}, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "the runtime layer failed to load: StackMismatchError" in done.stderr
    assert "torch-npu: expected 2.10.0.post4, found not installed" in done.stderr
    assert "Traceback" not in done.stderr
