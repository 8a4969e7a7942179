"""The system rules: /dev/shm, open files, locked memory."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
from support import doctor_env
from support.doctor_env import (
    NPU_SMI_A3,
    UNLIMITED,
    make_probe,
    make_tree,
    only,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, GIB, OK, WARN

shm_size = doctor_env.shm_size  # the fixture, under its own name


def test_shm_too_small_fails(tmp_path: Path, shm_size) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm_size(shm, 64 * 1024**2)  # docker's default 64 MiB
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=shm)
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == FAIL
    assert f"{shm} is 0.06 GiB" in finding.detail
    assert "--shm-size=64g" in finding.fix


def test_shm_missing_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=tmp_path / "no-shm")
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == FAIL and "no-shm is missing" in finding.detail and "--shm-size" in finding.fix


def test_shm_small_for_the_ram_warns(tmp_path: Path, shm_size) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm_size(shm, 2 * GIB)
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=shm, mem_total_bytes=1024 * GIB)
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == WARN and "2.0 GiB, under 10% of 1024 GiB RAM" in finding.detail


def test_shm_real_directory(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    size = st.f_blocks * st.f_frsize
    probe = make_probe([make_tree(tmp_path / "sp", {})], shm_path=tmp_path)
    finding = only(doctor.check_system(probe, "dev"), "system.shm")
    assert finding.status == (OK if size >= GIB else FAIL)
    assert str(tmp_path) in finding.detail


@pytest.mark.parametrize(
    ("soft", "status", "text"),
    [
        (1024, FAIL, "open files limit 1024"),
        (20000, WARN, "open files limit 20000 (Ray"),
        (1048576, OK, "open files limit 1048576"),
        (resource.RLIM_INFINITY, OK, "open files limit unlimited"),
    ],
)
def test_nofile(tmp_path: Path, soft: int, status: str, text: str) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], rlimits={"nofile": (soft, resource.RLIM_INFINITY)})
    finding = only(doctor.check_system(probe, "dev"), "system.nofile")
    assert finding.status == status
    assert text in finding.detail
    if status != OK:
        assert "ulimit -n 1048576" in finding.fix


def test_memlock_limited_on_a3_warns(tmp_path: Path) -> None:
    limited = {"memlock": (64 * 1024, 64 * 1024)}
    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3, rlimits=limited)
    finding = only(doctor.check_system(probe, "a3"), "system.memlock")
    assert finding.status == WARN
    assert "locked memory limit 64 KiB" in finding.detail
    assert finding.fix == "docker run --ulimit memlock=-1:-1"
    dev = only(doctor.check_system(probe, "dev"), "system.memlock")
    assert (dev.status, dev.fix) == (OK, "")


def test_memlock_unlimited_ok(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], rlimits={"memlock": UNLIMITED})
    finding = only(doctor.check_system(probe, "a3"), "system.memlock")
    assert (finding.status, finding.detail) == (OK, "locked memory unlimited")
