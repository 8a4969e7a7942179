"""``verl-npu doctor``: per-node environment check against the stack manifest.

The package, one small module per concern:

- :mod:`.probe`: what the doctor looks at (:class:`Probe`), and the readers the rules share;
- :mod:`.rules.platform`: the chip (one detector: verl_npu.stack.detect) and the NPUs a job expects;
- :mod:`.rules.versions`, :mod:`.rules.build`, :mod:`.rules.cann`, :mod:`.rules.installed`: the stack
  (versions and pairings, the build manifest, CANN and the driver, patches, modules, contracts);
- :mod:`.rules.env`: the variables verl reads; :mod:`.rules.system`: shm, nofile, memlock thresholds;
- :mod:`.rules.layer`: the runtime layer in a fresh process and a Ray worker;
- :mod:`.rules.network`: the hook to verl_npu.cluster.network;
- :mod:`.driver`: :func:`diagnose` and its :class:`Report`.

Findings are :class:`verl_npu.checks.Check` records (``Finding`` here). Nothing here imports torch,
torch_npu or megatron: a broken CANN setup must not crash the doctor.
"""

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.driver import Report, checked_target, diagnose
from verl_npu.doctor.probe import Probe, _canonical, _read_version_file, _release
from verl_npu.doctor.rules.build import check_build_manifest, read_built
from verl_npu.doctor.rules.cann import check_cann
from verl_npu.doctor.rules.env import (
    LAYER_MODULE,
    check_allocator_env,
    check_external_modules,
    check_glm52_rollout_patch,
)
from verl_npu.doctor.rules.installed import check_contracts, check_modules, check_patches
from verl_npu.doctor.rules.layer import check_layer, probe_layer
from verl_npu.doctor.rules.network import check_network_hook
from verl_npu.doctor.rules.platform import (
    EXPECT_NPUS_ENV,
    MOUNT_NPUS,
    check_expected_npus,
    check_platform,
    detect_platform,
)
from verl_npu.doctor.rules.system import GIB, check_memlock, check_nofile, check_shm, check_system
from verl_npu.doctor.rules.versions import check_torch_pairing, check_triton, check_versions
from verl_npu.stack.detect import Platform

__all__ = [
    "EXPECT_NPUS_ENV",
    "FAIL",
    "GIB",
    "LAYER_MODULE",
    "MOUNT_NPUS",
    "OK",
    "WARN",
    "Finding",
    "Platform",
    "Probe",
    "Report",
    "_canonical",
    "_read_version_file",
    "_release",
    "check_allocator_env",
    "check_build_manifest",
    "check_cann",
    "check_contracts",
    "check_expected_npus",
    "check_external_modules",
    "check_glm52_rollout_patch",
    "check_layer",
    "check_memlock",
    "check_modules",
    "check_network_hook",
    "check_nofile",
    "check_patches",
    "check_platform",
    "check_shm",
    "check_system",
    "check_torch_pairing",
    "check_triton",
    "check_versions",
    "checked_target",
    "detect_platform",
    "diagnose",
    "probe_layer",
    "read_built",
]
