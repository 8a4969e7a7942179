"""Numbers in other scripts (issue 29, class 4): every numeric option and variable verl-npu reads, against digit
strings Python's int() or float() would read and nothing downstream (bash, Ray, HCCL, Kubernetes) does.

Properties, for each surface of SURFACES:
- a string of Unicode decimal digits other than ASCII ('١٦', '१६', full-width, ...) is refused, naming the option
  or variable (an option: exit 2 before any work; a variable doctor checks: a FAIL finding; a reader: InputError);
- so is an ASCII number with one foreign character in it: another script's digit, a superscript or other
  numeric character ('²', '½', '①'), an underscore ('1_6'), a non-ASCII space at either end;
- an integer surface refuses Python's other integer spellings ('0x10', '1e1', '16.0');
- an ASCII decimal number in range is still read as that number.
install.sh's VERL_NPU_DETECT_TIMEOUT_S is checked by bash itself under a UTF-8 locale.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.paths import REPO

from verl_npu import inputs
from verl_npu.checks import FAIL
from verl_npu.cluster import network, smoke
from verl_npu.doctor import Probe
from verl_npu.doctor.rules import layer
from verl_npu.doctor.rules.platform import EXPECT_NPUS_ENV, check_expected_npus, expected_npus
from verl_npu.k8s.cli import _count
from verl_npu.preflight.pipeline import host_memory
from verl_npu.stack import detect
from verl_npu.stack.detect import Platform

CPU = Platform("cpu", "dev", "CPU only (no npu-smi, no nvidia-smi)")
ASCII_DIGITS = "0123456789"


# --- the strings -----------------------------------------------------------------------------------------------

OTHER_DIGITS = st.characters(categories=["Nd"], exclude_characters=ASCII_DIGITS)
# characters str.isdigit() or int() treats as (parts of) numbers that are not ASCII digits: other scripts' digits,
# superscripts, fractions, circled numbers, Roman numerals, the underscore of '1_6'
FOREIGN = st.one_of(OTHER_DIGITS, st.characters(categories=["No", "Nl"]), st.just("_"))
# spaces str.strip() and int() remove and nothing downstream does
FOREIGN_SPACE = st.characters(categories=["Zs", "Zl", "Zp"], exclude_characters=" ")


@st.composite
def hostile_numbers(draw, *, integer: bool) -> str:
    """A string a careless int()/float() reads as a number, and no ASCII reader does."""
    ascii_number = draw(st.integers(min_value=1, max_value=99999).map(str))
    kind = draw(st.sampled_from(["other script", "one foreign", "foreign space", "python syntax"]))
    if kind == "other script":
        return draw(st.text(OTHER_DIGITS, min_size=1, max_size=6))
    if kind == "one foreign":
        at = draw(st.integers(min_value=0, max_value=len(ascii_number)))
        return ascii_number[:at] + draw(FOREIGN) + ascii_number[at:]
    if kind == "foreign space":
        space = draw(FOREIGN_SPACE)
        return draw(st.sampled_from([space + ascii_number, ascii_number + space, space + ascii_number + space]))
    # int() itself refuses these, but a hand-written reader may not: an integer option must
    syntax = ["0x10", "0o20", "0b10", "1_6", "16.0", "1e1", "16L", "\u06616"]
    return draw(st.sampled_from(syntax if integer else ["0x10", "1_6", "16L", "\u06616", "inf", "nan", "-inf"]))


# --- the surfaces ------------------------------------------------------------------------------------------------


def _cli(argv: list[str]) -> tuple[int, str]:
    """`verl-npu ARGV` in this process: (exit code, stderr)."""
    from verl_npu.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


def _refused_by_cli(argv: list[str]) -> str:
    code, err = _cli(argv)
    assert code == 2, f"verl-npu {argv}: exit {code}\n{err}"
    assert "Traceback" not in err
    return err


def _smoke_refusal(argv: list[str]) -> str | None:
    """argparse's usage error for ``python -m verl_npu.cluster.smoke ARGV`` (exit 2), or None when it parses."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            smoke.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2, err.getvalue()
            return err.getvalue()
    return None


def _raises(read: Callable[[], object]) -> str | None:
    """The message of the InputError (or ValueError) ``read`` raises; None when it reads a value."""
    try:
        read()
    except (inputs.InputError, network.NetworkError, ValueError) as exc:
        return str(exc)
    return None


def _expect_npus_env(text: str) -> str | None:
    probe = Probe(env={EXPECT_NPUS_ENV: text}, sys_path=[], which=lambda name: None)
    (finding,) = check_expected_npus(probe, CPU)
    return finding.detail if finding.detail.startswith(f"{EXPECT_NPUS_ENV}=") else None


def _probe_timeout(text: str) -> str | None:
    with mock.patch.dict(os.environ, {detect.TIMEOUT_ENV: text}):
        return _raises(detect.command_timeout)


def _hccl_base_port_findings(text: str) -> list:
    return network.check_hccl_ports({"HCCL_IF_BASE_PORT": text}, "node7", lambda port: False, Path("/nonexistent"))


def _hccl_base_port_refusal(text: str) -> str | None:
    failed = [f for f in _hccl_base_port_findings(text) if f.status == FAIL and "is not a port in" in f.detail]
    return failed[0].detail if failed else None


def _hccl_base_port(text: str) -> int:
    """The base port the check worked with (each of its findings names it as HCCL_IF_BASE_PORT=N)."""
    named = (re.finditer(r"HCCL_IF_BASE_PORT=([0-9]+)", f.detail) for f in _hccl_base_port_findings(text))
    (base,) = {int(m[1]) for matches in named for m in matches}
    return base


def _port_range_findings(text: str) -> list:
    env = {"HCCL_HOST_SOCKET_PORT_RANGE": text}
    return network.check_hccl_ports(env, "node7", lambda port: False, Path("/nonexistent"))


def _port_range_refusal(text: str) -> str | None:
    failed = [f for f in _port_range_findings(text) if f.status == FAIL and "is not a port" in f.detail]
    return failed[0].detail if failed else None


def _port_range(text: str) -> int:
    """The first port of the ranges the check worked with, as its finding lists them ("61000-61010 free on ..." or
    "HCCL's host ports 61000-61010 (...) overlap ...")."""
    (finding,) = _port_range_findings(text)
    return int(re.search(r"(?:^|HCCL's host ports )([0-9]+)", finding.detail)[1])


# name shown in the message, kind, (low, high) of what it accepts, the refusal (message or None), the reading
Surface = tuple[str, str, tuple[float, float], Callable[[str], str | None], Callable[[str], float]]
SURFACES: dict[str, Surface] = {
    "verl-npu doctor --expect-npus": (
        "--expect-npus", "integer", (1, inputs.MAX_DEVICES),
        lambda t: _refused_by_cli(["doctor", "--no-layer", f"--expect-npus={t}"]),
        lambda t: expected_npus("--expect-npus", t),
    ),
    "verl-npu preflight --host-memory-gib": (
        "--host-memory-gib", "number", (1, inputs.MAX_GIB),
        lambda t: _refused_by_cli(["preflight", "--overrides", f"--host-memory-gib={t}", "x=1"]),
        host_memory,
    ),
    "verl-npu k8s render --nnodes": (  # the surface the others agree with (verl_npu/k8s/cli.py)
        "--nnodes", "integer", (1, inputs.MAX_DEVICES),
        lambda t: _refused_by_cli(["k8s", "render", "rayjob", f"--nnodes={t}"]), lambda t: _count("--nnodes")(t),
    ),
    "python -m verl_npu.cluster.smoke --expect": (
        "--expect", "integer", (1, inputs.MAX_DEVICES),
        lambda t: _smoke_refusal([f"--expect={t}"]), lambda t: smoke.parse_args([f"--expect={t}"]).expect,
    ),
    "python -m verl_npu.cluster.smoke --wait-timeout": (
        "--wait-timeout", "number", (1, smoke.MAX_TIMEOUT_S),
        lambda t: _smoke_refusal(["--expect=2", f"--wait-timeout={t}"]),
        lambda t: smoke.parse_args(["--expect=2", f"--wait-timeout={t}"]).wait_timeout,
    ),
    "python -m verl_npu.cluster.smoke --reduce-timeout": (
        "--reduce-timeout", "number", (1, smoke.MAX_TIMEOUT_S),
        lambda t: _smoke_refusal(["--expect=2", f"--reduce-timeout={t}"]),
        lambda t: smoke.parse_args(["--expect=2", f"--reduce-timeout={t}"]).reduce_timeout,
    ),
    "VERL_NPU_EXPECT_NPUS (doctor)": (
        EXPECT_NPUS_ENV, "integer", (1, inputs.MAX_DEVICES), _expect_npus_env,
        lambda t: expected_npus(EXPECT_NPUS_ENV, t),
    ),
    "VERL_NPU_DOCTOR_LAYER_TIMEOUT_S (doctor)": (
        layer.LAYER_TIMEOUT_VARIABLE, "number", (1, layer.MAX_LAYER_TIMEOUT_S),
        lambda t: _raises(lambda: layer.layer_timeout({layer.LAYER_TIMEOUT_VARIABLE: t})),
        lambda t: layer.layer_timeout({layer.LAYER_TIMEOUT_VARIABLE: t}),
    ),
    "RAY_gcs_server_port_wait_time_s (doctor)": (
        layer.RAY_START_WAIT_VARIABLE, "integer", (0, layer.MAX_LAYER_TIMEOUT_S),
        lambda t: _raises(lambda: layer.probe_environment({layer.RAY_START_WAIT_VARIABLE: t})),
        lambda t: int(layer.probe_environment({layer.RAY_START_WAIT_VARIABLE: t})[layer.RAY_START_WAIT_VARIABLE]),
    ),
    "VERL_NPU_PROBE_TIMEOUT_S (detection)": (
        detect.TIMEOUT_ENV, "number", (1, 3600), _probe_timeout,
        lambda t: mock.patch.dict(os.environ, {detect.TIMEOUT_ENV: t})(detect.command_timeout)(),
    ),
    **{
        f"{name} (network)": (
            name, "integer", (1, 65535),
            lambda t, name=name: _raises(lambda: network.ray_start_args({name: t}, "head")),
            lambda t, name=name: network.env_port({name: t}, name),
        )
        for name in network.RAY_PORT_VARIABLES
    },
    "HCCL_IF_BASE_PORT (network)": (
        "HCCL_IF_BASE_PORT", "integer", network.HCCL_BASE_PORT_LIMITS, _hccl_base_port_refusal, _hccl_base_port,
    ),
    "HCCL_HOST_SOCKET_PORT_RANGE (network)": (
        "HCCL_HOST_SOCKET_PORT_RANGE", "integer", (1, 65535), _port_range_refusal, _port_range,
    ),
}  # fmt: skip


@pytest.mark.parametrize("surface", sorted(SURFACES))
@given(data=st.data())
def test_a_number_in_another_script_is_refused_naming_where_it_came_from(surface, data):
    name, kind, _, refusal, _ = SURFACES[surface]
    text = data.draw(hostile_numbers(integer=kind == "integer"), label="value")
    message = refusal(text)
    assert message is not None, f"{surface}: {text!r} was read as a number"
    assert f"{name}=" in message, message


@pytest.mark.parametrize("surface", sorted(SURFACES))
@given(data=st.data())
def test_an_ascii_number_in_range_is_still_read(surface, data):
    _, kind, (low, high), _, read = SURFACES[surface]
    if kind == "integer":
        value = data.draw(st.integers(min_value=int(low), max_value=int(high)), label="value")
        text = str(value)
    else:
        value = data.draw(st.integers(min_value=int(low), max_value=int(high)), label="value")
        text = data.draw(st.sampled_from([str(value), f"{value}.0", f"{value:e}"]), label="spelled")
    assert read(text) == pytest.approx(value)


@given(text=hostile_numbers(integer=True))
def test_install_sh_reads_its_detection_timeout_in_ascii_digits_under_a_utf8_locale(text):
    """Bash itself decides: install.sh stops before finding Python, exit 2, naming the variable."""
    env = {**os.environ, "VERL_NPU_DETECT_TIMEOUT_S": text, "LC_ALL": "C.UTF-8", "VERL_NPU_TARGET": ""}
    done = subprocess.run(
        ["bash", str(REPO / "install.sh"), "--target", "dev", "--dry-run"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "VERL_NPU_DETECT_TIMEOUT_S=" in done.stderr and "plan for target" not in done.stdout
