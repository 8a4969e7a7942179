"""verl's Megatron engine imported without its driver stack (verl_npu/testing/verl_without_driver.py), as the
nvidia-h200 benchmark machine must: on the CPU, in a process where ray, datasets, pandas, wandb and tensorboard
are stood in for, the engine class is verl's own, from its installed file, no real driver-stack module loads, and
a call into a stand-in stops with the name it reached."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl", reason="verl is not installed here")

CHILD = textwrap.dedent(
    """
    import json, sys
    from verl_npu.testing import verl_without_driver as loader

    impl = loader.import_engine(absent=loader.DRIVER_STACK)
    real = sorted({name.partition(".")[0] for name, module in sys.modules.items()
                   if name.partition(".")[0] in loader.DRIVER_STACK and getattr(module, "__file__", None)})
    ray = sys.modules["ray"]
    try:
        ray.get([])
        used = None
    except loader.DriverStackUsed as exc:
        used = str(exc)
    print(json.dumps({
        "engine_file": sys.modules[impl.MegatronEngineWithLMHead.__module__].__file__,
        "engine": impl.MegatronEngineWithLMHead.__qualname__,
        "stood_in": list(loader.stood_in()),
        "real_driver_modules": real,
        "touched": loader.touched(),
        "used": used,
    }))
    """
)


@pytest.fixture(scope="module")
def child():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_is_verls_own_class_from_its_installed_file(child):
    import verl

    assert child["engine"] == "MegatronEngineWithLMHead"
    assert child["engine_file"].startswith(verl.__path__[0]) and child["engine_file"].endswith(
        "workers/engine/megatron/transformer_impl.py"
    )


def test_no_real_driver_stack_module_loads_and_the_stand_ins_are_named(child):
    assert child["real_driver_modules"] == []
    assert child["stood_in"] == ["ray", "datasets", "pandas", "wandb", "tensorboard"]
    assert "ray.ObjectRef" in child["touched"]  # an annotation in verl.protocol, evaluated at import


def test_a_call_into_a_stand_in_stops_naming_what_it_reached(child):
    assert child["used"] is not None and child["used"].startswith("ray.get was called: ray is not installed here")


def test_only_the_driver_stack_may_be_stood_in_for():
    from verl_npu.testing import verl_without_driver as loader

    with pytest.raises(ValueError, match=r"absent=\['torch'\]: only the driver stack"):
        loader.import_engine(absent=("torch",))
