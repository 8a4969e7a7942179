"""verl_npu.cluster.network: per-node interface choice, the network checks, and ray_start.sh around them.

Sysfs, port state and addresses are given to the checks as a fake tree / functions where the test
needs a particular node; the functions that read this machine (addresses, routes, port probe,
running a tool) are also run for real.

Where the fixture outputs of the Ascend tools come from:
- ``hccn_tool -i N -ip -g``: ``ipaddr:ADDRESS`` and ``netmask:MASK`` lines, as a real 910B node answers
  (tests_npu/data/hccn_tool/, source in tests_npu/data/SOURCES.md). vllm-ascend's multi-node guide
  greps ``ipaddr`` from it and its ranktable generator splits that line at ``:``.
- ``hccn_tool -i N -link -g``: ``link status: UP`` (or ``DOWN``), the form of Huawei's HCCN Tool
  interface reference; vllm-ascend's guide checks that every NPU reports ``UP``. The exact line is
  not in any source we could read, so the parser accepts any case and spacing and anything else
  is reported as unrecognised (a test below).
- ``/proc/net/route`` and ``/proc/net/if_inet6``: Linux procfs formats (copied from a live node).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.cluster import network
from verl_npu.cluster.network import (
    IfnameSpec,
    NetworkError,
    check_network,
    hccl_interface,
    node_env,
    node_network,
    parse_hccl_ifname,
    parse_hccn_ip,
    parse_hccn_link,
    ray_start_args,
)
from verl_npu.doctor import FAIL, OK, WARN

NODE = "node7"

HCCN_IP_OUTPUT = "ipaddr:29.88.1.{n}\nnetmask:255.255.0.0\n"
HCCN_LINK_UP = "link status: UP\n"
HCCN_LINK_DOWN = "link status: DOWN\n"
PROC_NET_ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "bond0\t00000000\t0101A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
    "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
    "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
)
PROC_NET_ROUTE_NO_DEFAULT = PROC_NET_ROUTE.splitlines()[0] + "\n" + PROC_NET_ROUTE.splitlines()[3] + "\n"
PROC_NET_IF_INET6 = (
    "00000000000000000000000000000001 01 80 10 80       lo\nfd000000000000000000000000000002 04 40 00 82     eth0\n"
)


# --- HCCL_SOCKET_IFNAME --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        ("eth,enp", IfnameSpec(("eth", "enp"), exact=False, exclude=False)),
        ("=eth0,enp0", IfnameSpec(("eth0", "enp0"), exact=True, exclude=False)),
        ("^eth", IfnameSpec(("eth",), exact=False, exclude=True)),
        ("^=eth0, enp0", IfnameSpec(("eth0", "enp0"), exact=True, exclude=True)),
    ],
)
def test_the_four_documented_forms_of_hccl_socket_ifname_parse(value, spec):
    assert parse_hccl_ifname(value) == spec


@pytest.mark.parametrize("value", ["", "=", "^", "eth0,,enp0", "^^eth", "=eth0,=enp0", "eth 0", "eth0;enp0"])
def test_forms_hccl_does_not_document_are_refused_naming_the_value(value):
    with pytest.raises(ValueError, match="HCCL_SOCKET_IFNAME=") as raised:
        parse_hccl_ifname(value)
    assert repr(value) in str(raised.value)


INTERFACES = ["docker0", "enp189s0f0", "eth0", "eth10", "lo"]


@pytest.mark.parametrize(
    ("value", "chosen"),
    [
        ("eth", "eth0"),  # prefix: the first matching name
        ("eth1", "eth10"),  # a bare name is a prefix for HCCL
        ("=eth1", None),  # exact: eth10 does not count
        ("=eth9,eth0", "eth0"),  # the first listed name this node has
        ("^eth", "enp189s0f0"),
        ("^=enp189s0f0,eth0", "eth10"),
        ("^=enp189s0f0,eth0,eth10", "docker0"),  # then docker, then lo
        (None, "enp189s0f0"),  # unset: HCCL's own order
    ],
)
def test_the_interface_hccl_takes_follows_its_documented_order(value, chosen):
    spec = parse_hccl_ifname(value) if value else None
    assert hccl_interface(spec, INTERFACES) == chosen


# --- the checks on a constructed node -----------------------------------------------------------


def make_sysfs(root: Path, interfaces: dict[str, tuple[str, str | None]]) -> Path:
    """/sys/class/net with each interface's operstate and carrier (None: unreadable, as when down)."""
    base = root / "sys_class_net"
    for name, (operstate, carrier) in interfaces.items():
        (base / name).mkdir(parents=True)
        (base / name / "operstate").write_text(operstate + "\n")
        if carrier is not None:
            (base / name / "carrier").write_text(carrier + "\n")
    return base


def make_proc_sys(root: Path, ephemeral: str = "32768\t60999", reserved: str = "") -> Path:
    ipv4 = root / "proc_sys" / "net" / "ipv4"
    ipv4.mkdir(parents=True)
    (ipv4 / "ip_local_port_range").write_text(ephemeral + "\n")
    (ipv4 / "ip_local_reserved_ports").write_text(reserved + "\n")
    return root / "proc_sys"


@pytest.fixture
def node(tmp_path):
    """A node with a good eth0, an administratively down ib0, an eth1 without carrier, an up eth2
    without address, and lo; HCCL's default ports reserved; no NPU."""
    sysfs = make_sysfs(
        tmp_path,
        {
            "eth0": ("up", "1"),
            "ib0": ("down", None),
            "eth1": ("up", "0"),
            "eth2": ("up", "1"),
            "lo": ("unknown", "1"),
        },
    )
    proc_sys = make_proc_sys(tmp_path, reserved="60000-60031")
    (tmp_path / "dev").mkdir()
    held = {"eth0": ["10.0.0.7", "fe80::7"], "eth1": ["10.1.0.7"], "lo": ["127.0.0.1", "::1"]}
    busy: set[int] = set()

    def run(env, **overrides):
        options = {
            "sys_class_net": sysfs,
            "port_in_use": lambda port: port in busy,
            "node": NODE,
            "proc_sys": proc_sys,
            "dev": tmp_path / "dev",
            "addresses": lambda: held,
            "run": lambda *a, **k: pytest.fail("no tool may run on a node without NPU"),
        }
        return check_network(env, **{**options, **overrides})

    run.busy, run.held, run.tmp = busy, held, tmp_path
    return run


GOOD = {"HCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}


def by_check(findings, check):
    return [f for f in findings if f.check == check]


def test_a_well_set_node_passes_every_check(node):
    findings = node(GOOD)
    assert all(f.check.startswith("network.") for f in findings)
    assert [f for f in findings if f.status != OK] == []
    assert {f.check for f in findings} >= {
        "network.hccl_ifname",
        "network.gloo_ifname",
        "network.tp_ifname",
        "network.hccl_ports",
        "network.npu_nic",
    }
    assert "eth0 on node7 is up (10.0.0.7)" in by_check(findings, "network.hccl_ifname")[0].detail


@pytest.mark.parametrize(
    ("variable", "value", "detail", "fix"),
    [
        ("GLOO_SOCKET_IFNAME", "eth9", "eth9 does not exist on node7 (interfaces: eth0, eth1, eth2, ib0, lo)",
         "name an interface"),
        ("HCCL_SOCKET_IFNAME", "=ib0", "interface ib0 on node7 is down (operstate down)", "ip link set ib0 up"),
        ("HCCL_SOCKET_IFNAME", "=eth1", "interface eth1 on node7 has no carrier", "ip link set eth1 up"),
        ("TP_SOCKET_IFNAME", "eth2", "interface eth2 on node7 has no IP address", "give eth2 an address"),
        ("HCCL_SOCKET_IFNAME", "=bond0", "no interface on node7 matches", "need their own value"),
        ("HCCL_SOCKET_IFNAME", "eth0;eth1", "is not an interface name", "write it as `=eth0`"),
        ("GLOO_SOCKET_IFNAME", "=eth0", "'=eth0' is not an interface name", "HCCL_SOCKET_IFNAME's syntax"),
    ],
)  # fmt: skip
def test_a_bad_interface_fails_naming_node_interface_and_fix(node, variable, value, detail, fix):
    findings = node({**GOOD, variable: value})
    failed = [f for f in findings if f.status == FAIL]
    assert len(failed) == 1, failed
    assert failed[0].check == f"network.{variable.split('_')[0].lower()}_ifname"
    assert detail in failed[0].detail and fix in failed[0].fix


def test_unset_interface_variables_warn_with_the_interface_hccl_would_pick(node):
    findings = node({})
    hccl, gloo = by_check(findings, "network.hccl_ifname"), by_check(findings, "network.gloo_ifname")
    # HCCL's own order: other interfaces by name first, so eth0 here; fine, but not chosen for the head
    assert hccl[0].status == WARN and "HCCL picks eth0 on node7" in hccl[0].detail
    assert gloo[0].status == WARN and "ray_start.sh sets it per node" in gloo[0].fix
    assert by_check(findings, "network.tp_ifname") == []  # nothing falls back on it for HCCL or Gloo


def test_hccl_if_ip_must_be_an_address_of_this_node(node):
    assert by_check(node({**GOOD, "HCCL_IF_IP": "10.0.0.7"}), "network.hccl_if_ip")[0].status == OK
    failed = by_check(node({**GOOD, "HCCL_IF_IP": "10.0.0.99"}), "network.hccl_if_ip")[0]
    assert failed.status == FAIL and "HCCL_IF_IP=10.0.0.99 is not an address of node7" in failed.detail


def test_an_interface_other_than_the_one_towards_the_head_is_flagged(node):
    # the kernel reaches 127.0.0.1 through lo, so lo is this node's interface towards that "head"
    node.held["lo"] = ["127.0.0.1"]
    findings = node(GOOD, head="127.0.0.1")
    assert (
        by_check(findings, "network.route_to_head")[0].detail == "node7 reaches the head 127.0.0.1 from 127.0.0.1 (lo)"
    )
    hccl = by_check(findings, "network.hccl_ifname")[0]
    assert hccl.status == WARN and "reaches the head through lo" in hccl.detail


def test_a_head_no_interface_of_this_node_reaches_fails(node):
    node.held.clear()
    node.held["eth0"] = ["10.0.0.7"]  # the kernel answers from 127.0.0.1, which no listed interface holds
    failed = by_check(node(GOOD, head="127.0.0.1"), "network.route_to_head")[0]
    assert failed.status == FAIL and "which no interface of this node holds" in failed.detail


# --- ports ---------------------------------------------------------------------------------------


def test_hccl_ports_clashing_with_ray_fail_naming_both(node):
    findings = node({**GOOD, "HCCL_IF_BASE_PORT": "10500"})
    failed = [f for f in by_check(findings, "network.hccl_ports") if f.status == FAIL]
    assert "HCCL's host ports 10500-10531 (HCCL_IF_BASE_PORT=10500) overlap" in failed[0].detail
    assert "Ray worker ports (RAY_MIN_WORKER_PORT-RAY_MAX_WORKER_PORT) 10002-19999 on node7" in failed[0].detail

    findings = node({**GOOD, "HCCL_IF_BASE_PORT": "6370", "RAY_PORT": "6390"})
    detail = next(f for f in by_check(findings, "network.hccl_ports") if f.status == FAIL).detail
    assert "Ray GCS (RAY_PORT) 6390" in detail
    # moved clear of the worker range, the same base is fine
    clear = node({**GOOD, "HCCL_IF_BASE_PORT": "10500", "RAY_MIN_WORKER_PORT": "20000", "RAY_MAX_WORKER_PORT": "29999"})
    assert all(f.status != FAIL for f in by_check(clear, "network.hccl_ports"))


def test_hccl_ports_in_use_fail_naming_them_and_how_to_find_the_holder(node):
    node.busy.update({60005, 60031})
    failed = next(f for f in by_check(node(GOOD), "network.hccl_ports") if f.status == FAIL)
    assert "HCCL's host ports in use on node7: 60005, 60031" in failed.detail
    assert "(HCCL_IF_BASE_PORT=60000 (CANN's default), range 60000-60031)" in failed.detail
    assert "ss -ltnp 'sport = :60005'" in failed.fix


@pytest.mark.parametrize("value", ["abc", "1000", "65521", "-1"])
def test_an_hccl_base_port_out_of_cann_s_range_fails_naming_it(node, value):
    failed = by_check(node({**GOOD, "HCCL_IF_BASE_PORT": value}), "network.hccl_ports")
    assert (
        failed[0].status == FAIL
        and f"HCCL_IF_BASE_PORT={value!r} on node7 is not a port in 1024-65520" in failed[0].detail
    )


def test_hccl_host_socket_port_range_takes_precedence_and_is_parsed(node):
    node.busy.add(61020)
    findings = node({**GOOD, "HCCL_IF_BASE_PORT": "10500", "HCCL_HOST_SOCKET_PORT_RANGE": "61000-61010, 61020"})
    failed = [f for f in by_check(findings, "network.hccl_ports") if f.status == FAIL]
    assert len(failed) == 1 and "in use on node7: 61020" in failed[0].detail  # no Ray clash: the base is ignored
    auto = by_check(node({**GOOD, "HCCL_HOST_SOCKET_PORT_RANGE": "auto"}), "network.hccl_ports")
    assert auto[0].status == OK and "the OS picks" in auto[0].detail
    bad = by_check(node({**GOOD, "HCCL_HOST_SOCKET_PORT_RANGE": "61000-"}), "network.hccl_ports")
    assert bad[0].status == FAIL and "'61000-' is not a port or a range" in bad[0].detail


def test_hccl_ports_in_the_unreserved_ephemeral_range_warn_with_the_sysctl(node):
    proc_sys = make_proc_sys(node.tmp / "other")  # nothing reserved
    warned = by_check(node(GOOD, proc_sys=proc_sys), "network.hccl_ports")
    assert [f.status for f in warned] == [WARN]
    assert "60000-60031 lie in node7's ephemeral range 32768-60999" in warned[0].detail
    assert warned[0].fix == "sysctl -w net.ipv4.ip_local_reserved_ports=60000-60031"


def test_on_the_head_before_ray_start_rays_own_ports_must_be_free(node):
    node.busy.add(6390)
    failed = by_check(node({**GOOD, "RAY_PORT": "6390"}, role="head"), "network.ray_ports")[0]
    assert failed.status == FAIL and "in use on node7: Ray GCS (RAY_PORT) 6390" in failed.detail
    assert "ray stop" in failed.fix
    assert by_check(node({**GOOD, "RAY_PORT": "6390"}), "network.ray_ports") == []  # doctor: Ray may run


def test_the_port_probe_sees_a_listener_on_any_address():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert network.tcp_port_in_use(port)
    assert not network.tcp_port_in_use(port)


# --- hccn_tool ------------------------------------------------------------------------------------


FAKE_HCCN_TOOL = """#!/usr/bin/env bash
# answers `hccn_tool -i N -ip|-link -g` from files answers/N-ip, answers/N-link (+ .rc: exit code, .sleep: seconds)
answer="$(dirname "$0")/answers/$2$3"
if [[ -f "$answer.sleep" ]]; then sleep "$(cat "$answer.sleep")"; fi
if [[ -f "$answer" ]]; then cat "$answer"; fi
exit "$(cat "$answer.rc" 2>/dev/null || echo 0)"
"""


@pytest.fixture
def npus(node, monkeypatch):
    """Four NPUs (/dev/davinci0-3) and an hccn_tool on PATH answering from files."""
    tmp = node.tmp
    for name in ("davinci0", "davinci1", "davinci2", "davinci3", "davinci_manager", "devmm_svm"):
        (tmp / "dev" / name).write_text("")
    tools = tmp / "tools"
    (tools / "answers").mkdir(parents=True)
    tool = tools / "hccn_tool"
    tool.write_text(FAKE_HCCN_TOOL)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(network, "HCCN_TOOL_DIRS", ())

    def answer(device: int, what: str, output: str | bytes, rc: int = 0, sleep: float | None = None):
        path = tools / "answers" / f"{device}-{what}"
        path.write_bytes(output.encode() if isinstance(output, str) else output)
        (tools / "answers" / f"{device}-{what}.rc").write_text(str(rc))
        if sleep is not None:
            (tools / "answers" / f"{device}-{what}.sleep").write_text(str(sleep))

    for device in range(4):
        answer(device, "ip", HCCN_IP_OUTPUT.format(n=device + 1))
        answer(device, "link", HCCN_LINK_UP)

    def run(**env):
        return node({**GOOD, "PATH": f"{tools}:/usr/bin:/bin", **env}, run=network.run_command)

    run.answer = answer
    return run


def test_every_npus_device_ip_and_link_pass(npus):
    nic = [f for f in npus() if f.check.startswith("network.npu")]
    assert [(f.check, f.status) for f in nic] == [("network.npu_nic", OK)]
    assert "4 NPUs on node7: device IPs set, links UP" in nic[0].detail


def test_a_down_link_and_a_missing_device_ip_fail_naming_the_npus(npus):
    npus.answer(2, "link", HCCN_LINK_DOWN)
    npus.answer(1, "ip", "")
    findings = npus()
    link = by_check(findings, "network.npu_link")[0]
    assert link.status == FAIL and link.detail == "device NIC link DOWN on node7: npu 2"
    assert "optical modules" in link.fix
    ip = by_check(findings, "network.npu_ip")[0]
    assert ip.status == FAIL and "no device IP on node7 for npu 1 (no output)" in ip.detail
    assert "/etc/hccn.conf" in ip.fix


def test_two_npus_with_one_device_ip_fail(npus):
    npus.answer(3, "ip", HCCN_IP_OUTPUT.format(n=1))
    failed = by_check(npus(), "network.npu_ip")[0]
    assert failed.status == FAIL and "device IPs repeat on node7: 29.88.1.1 on npus 0, 3" in failed.detail


def test_odd_tool_output_is_reported_without_a_traceback(npus, monkeypatch):
    monkeypatch.setattr(network, "COMMAND_TIMEOUT_S", 1.0)
    npus.answer(0, "ip", b"\xff\xfe\x00driver error\n", rc=255)  # not UTF-8, exit 255
    npus.answer(1, "link", b"\xc3\x28 link: ?\n")  # exit 0 but no status line
    npus.answer(2, "link", HCCN_LINK_UP, sleep=60)  # hangs past the timeout
    started = time.monotonic()
    findings = npus()
    assert time.monotonic() - started < 30  # the hung tool was killed, with its children
    unreadable = by_check(findings, "network.npu_nic")[0]
    assert unreadable.status == WARN
    assert "npu 0 -ip: exit 255:" in unreadable.detail and "driver error" in unreadable.detail
    assert "npu 2 -link: no answer within 1 s" in unreadable.detail
    unknown = by_check(findings, "network.npu_link")[0]
    assert unknown.status == WARN and "unrecognised `hccn_tool -link -g` output on node7: npu 1" in unknown.detail
    assert all(f.status != FAIL for f in findings)


def test_without_hccn_tool_the_device_checks_are_skipped_saying_so(npus):
    findings = npus(PATH="/nonexistent")
    nic = by_check(findings, "network.npu_nic")[0]
    assert nic.status == OK and "hccn_tool not found on node7" in nic.detail and "skipped" in nic.detail


def test_the_ip_parser_reads_a_real_nodes_answer():
    capture = REPO / "tests_npu" / "data" / "hccn_tool" / "ip_-i3_910B1_arthurchiao.txt"
    assert parse_hccn_ip(capture.read_text()) == "29.1.112.213"


def test_the_tool_parsers_read_the_documented_lines():
    assert parse_hccn_ip("ipaddr:192.168.1.8\nnetmask:255.255.255.0\n") == "192.168.1.8"
    assert parse_hccn_ip("ipaddr:\nnetmask:255.255.255.0\n") is None
    assert parse_hccn_ip("") is None
    assert parse_hccn_link("link status: UP\n") == "UP"
    assert parse_hccn_link("Link Status:down") == "DOWN"
    assert parse_hccn_link("link status: unknown") is None


# --- this machine ---------------------------------------------------------------------------------


def test_this_machines_addresses_and_route_to_a_loopback_head():
    addresses = network.interface_addresses()
    assert "127.0.0.1" in addresses["lo"]
    assert node_network("127.0.0.1") == network.NodeNetwork("127.0.0.1", "lo")
    assert node_network("127.0.0.9").interface == "lo"  # all of 127/8 is routed through lo


def test_the_head_takes_the_address_of_its_default_routes_interface(tmp_path):
    routes = tmp_path / "route"
    routes.write_text(PROC_NET_ROUTE)  # bond0 has the default route at metric 100, eth0 at 0
    found = node_network("auto", route_table=routes, addresses=lambda: {"eth0": ["fd00::2", "192.0.2.2"]})
    assert found == network.NodeNetwork("192.0.2.2", "eth0")
    routes.write_text(PROC_NET_ROUTE_NO_DEFAULT)
    with pytest.raises(NetworkError, match=r"no default route .* pass it: `ray_start.sh head NODE_IP`"):
        node_network("auto", route_table=routes, addresses=lambda: {"eth0": ["192.0.2.2"]})


def test_an_unresolvable_head_is_refused_naming_it():
    with pytest.raises(NetworkError, match=r"cannot resolve the head address 'no-such-head\.invalid'"):
        node_network("no-such-head.invalid")


def test_ipv6_addresses_are_read_from_procfs():
    assert network.parse_if_inet6(PROC_NET_IF_INET6 + "garbage line\n") == [("lo", "::1"), ("eth0", "fd00::2")]


def test_node_env_keeps_what_the_operator_set_and_fills_the_rest():
    here = network.NodeNetwork("10.0.0.7", "enp189s0f0")
    assert node_env(here, {"GLOO_SOCKET_IFNAME": "bond0"}) == {
        "NODE_IP": "10.0.0.7",
        "HCCL_SOCKET_IFNAME": "=enp189s0f0",  # exact: a bare name is a prefix for HCCL
        "TP_SOCKET_IFNAME": "enp189s0f0",
    }


def test_ray_start_args_carry_the_node_ip_and_the_ports_the_check_checked():
    env = {"NODE_IP": "10.0.0.7", "RAY_PORT": "6390", "RAY_DASHBOARD_PORT": "8300", "RAY_MIN_WORKER_PORT": "20000"}
    assert ray_start_args(env, "head") == [
        "--node-ip-address=10.0.0.7",
        "--port=6390",
        "--dashboard-port=8300",
        "--min-worker-port=20000",
    ]
    assert ray_start_args(env, "worker") == ["--node-ip-address=10.0.0.7", "--min-worker-port=20000"]
    with pytest.raises(NetworkError, match=r"RAY_NODE_MANAGER_PORT='x1' is not a port number"):
        ray_start_args({**env, "RAY_NODE_MANAGER_PORT": "x1"}, "worker")


# --- ray_start.sh ----------------------------------------------------------------------------------


FAKE_RAY = """#!/usr/bin/env bash
# records how ray_start.sh started Ray, with the interface variables it exported
printf '%s\\n' "$*" "HCCL=${HCCL_SOCKET_IFNAME:-} GLOO=${GLOO_SOCKET_IFNAME:-} TP=${TP_SOCKET_IFNAME:-}" > "$RAY_CALLS"
"""


def ray_start(tmp_path, *args: str, extra_env: str = "") -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "ray"
    fake.write_text(FAKE_RAY)
    fake.chmod(0o755)
    # python3 on PATH must be the one that imports verl_npu, as in the image
    (bin_dir / "python3").unlink(missing_ok=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    env_file = tmp_path / "cluster.env"
    shipped = (REPO / "examples" / "glm5_2" / "glm5_2.env").read_text()
    env_file.write_text(shipped + "HCCL_IF_BASE_PORT=61200\n" + extra_env)
    calls = tmp_path / "ray_calls"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "ENV_FILE": str(env_file),
        "RAY_CALLS": str(calls),
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", str(REPO / "examples" / "glm5_2" / "ray_start.sh"), *args],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    return done, calls


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_worker_exports_its_own_interface_checks_and_starts_ray_on_its_address(tmp_path):
    done, calls = ray_start(tmp_path, "worker", "127.0.0.1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[OK  ] network.hccl_ifname: HCCL_SOCKET_IFNAME==lo: lo on" in done.stdout
    started, exported = calls.read_text().splitlines()
    assert started == "start --address=127.0.0.1:6379 --node-ip-address=127.0.0.1"
    assert exported == "HCCL==lo GLOO=lo TP=lo"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failed_network_check_stops_the_node_before_ray_starts(tmp_path):
    done, calls = ray_start(tmp_path, "worker", "127.0.0.1", extra_env="GLOO_SOCKET_IFNAME=nosuch0\n")
    assert done.returncode == 1
    assert "[FAIL] network.gloo_ifname: GLOO_SOCKET_IFNAME=nosuch0: interface nosuch0 does not exist" in done.stdout
    assert "the network check failed on" in done.stderr
    assert not calls.exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_head_address_that_is_not_routable_stops_the_node(tmp_path):
    done, calls = ray_start(tmp_path, "worker", "no-such-head.invalid")
    assert done.returncode == 2
    assert "cannot resolve the head address 'no-such-head.invalid'" in done.stderr
    assert not calls.exists()


def test_the_shipped_env_file_leaves_the_interface_variables_to_each_node():
    from verl_npu.runtime_patches.ray_runtime_env import env_file_variables

    shipped = env_file_variables(str(REPO / "examples" / "glm5_2" / "glm5_2.env"))
    assert not set(network.IFNAME_VARIABLES) & set(shipped)


def test_doctor_runs_the_network_checks_on_an_ascend_target_and_fails_on_a_down_interface(node, tmp_path):
    from support.doctor_env import NPU_SMI_A3, STACK, make_probe, make_tree

    from verl_npu import doctor

    probe = make_probe([make_tree(tmp_path / "sp", {})], npu=NPU_SMI_A3, env={**GOOD, "HCCL_SOCKET_IFNAME": "=ib0"})
    probe.network = node
    report = doctor.diagnose(probe, STACK)
    hccl = by_check(report.findings, "network.hccl_ifname")
    assert hccl and hccl[0].status == FAIL and "ib0" in hccl[0].detail
    assert report.failed

    # a dev box is not checked, and says so
    dev = make_probe([make_tree(tmp_path / "dev-sp", {})], env={"HCCL_SOCKET_IFNAME": "=ib0"})
    dev.network = lambda env: pytest.fail("network checks ran on a dev target")
    assert [f.status for f in doctor.diagnose(dev, STACK).findings if f.check == "network"] == [OK]
