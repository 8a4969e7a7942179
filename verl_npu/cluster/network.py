"""The network a multi-node Ascend job depends on: which interface each node uses, and whether it works.

Nodes of one cluster often name their interfaces differently (``eth0`` on one, ``enp189s0f0`` or
``bond0`` on another), so HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME are decided on each node, from the
interface that routes to the Ray head, not copied from the driver. ``ray_start.sh`` runs, before
``ray start``::

    python3 -m verl_npu.cluster.network node-env --head HEAD_IP   # NODE_IP=... and the *_SOCKET_IFNAME lines
    python3 -m verl_npu.cluster.network check --role worker --head HEAD_IP
    python3 -m verl_npu.cluster.network ray-args --role worker    # the `ray start` options for this node

``check`` (and ``verl-npu doctor``, through :func:`check_network`) reports, each finding naming the
node, interface or port and the fix: the interfaces HCCL and Gloo will use exist, are up and have
an address; the HCCL host ports are free and clear of Ray's; each NPU's device NIC has an IP and
its link is up (``hccn_tool``, where the driver tools are installed).

Sources: HCCL_SOCKET_IFNAME syntax, HCCL_IF_BASE_PORT and HCCL_HOST_SOCKET_PORT_RANGE from the CANN
environment variable reference (hiascend.com, CANN 8.x/9.0, envref_07_0074/0075/0143); Ray's
default ports from ray 2.60 (``ray/_private/ray_constants.py``, ``ray/scripts/scripts.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import ipaddress
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from verl_npu import inputs, processes
from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding

# TP_SOCKET_IFNAME: TensorPipe (torch.distributed.rpc) reads it; set with the others so that nothing
# in a worker falls back to the interface its hostname resolves to.
IFNAME_VARIABLES = ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")

# CANN 9.0's HCCL reference: without HCCL_IF_BASE_PORT, HCCL takes 60000-60031 on the host for
# cluster information when a communicator is built from root info (CANN 8.0 took 16 ports; the
# larger range covers both). HCCL_HOST_SOCKET_PORT_RANGE (CANN 8.5+) takes precedence over both.
HCCL_DEFAULT_BASE_PORT = 60000
HCCL_BASE_PORT_SPAN = 32
HCCL_BASE_PORT_LIMITS = (1024, 65520)

# Ray 2.60 defaults for the ports `ray start` binds at fixed numbers (the others are picked at random).
RAY_DEFAULT_GCS_PORT = 6379
RAY_DEFAULT_DASHBOARD_PORT = 8265
RAY_CLIENT_SERVER_PORT = 10001
RAY_DASHBOARD_AGENT_LISTEN_PORT = 52365
RAY_DEFAULT_WORKER_PORTS = (10002, 19999)

COMMAND_TIMEOUT_S = 10.0
HCCN_TOOL_DIRS = ("/usr/local/Ascend/driver/tools",)  # where the driver installs it, often not on PATH


class NetworkError(RuntimeError):
    """A node's network cannot serve the job; the message names what and the fix."""


# --- running tools -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommandResult:
    returncode: int | None  # None: it did not finish within the timeout
    output: str  # stdout then stderr, undecodable bytes replaced


def run_command(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> CommandResult | None:
    """Run a tool; None when it is not there or cannot be executed.

    On a timeout its whole process group is ended (verl_npu.processes): a child holding the pipes would block us.
    """
    try:
        done = processes.run(argv, timeout=timeout)
    except (FileNotFoundError, PermissionError):
        return None
    except OSError as exc:  # e.g. a file with the tool's name that is not an executable (ENOEXEC)
        return CommandResult(126, f"{argv[0]}: {exc.strerror or exc}")
    return CommandResult(None if done.timed_out else done.returncode, str(done.stdout) + str(done.stderr))


def _excerpt(text: str, limit: int = 120) -> str:
    """One printable line of a tool's output, for a message."""
    flat = " ".join(text.split())
    flat = "".join(c if c.isprintable() else "?" for c in flat)
    if not flat:
        return "no output"
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# --- this node's interfaces and addresses --------------------------------------------------------


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for every IPv4 address of this node, secondary ones included (SIOCGIFCONF)."""
    import array
    import fcntl
    import struct

    siocgifconf = 0x8912
    ifreq_size = 40 if struct.calcsize("P") == 8 else 32  # struct ifreq: 16-byte name + the address union
    capacity = 64
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while True:
            buffer = array.array("B", bytes(capacity * ifreq_size))
            request = struct.pack("iP", len(buffer), buffer.buffer_info()[0])
            used = struct.unpack("iP", fcntl.ioctl(sock.fileno(), siocgifconf, request))[0]
            if used < len(buffer):
                break
            capacity *= 4
    data = buffer.tobytes()[:used]
    found = []
    for start in range(0, used, ifreq_size):
        name = data[start : start + 16].split(b"\0", 1)[0].decode("utf-8", errors="replace")
        found.append((name, socket.inet_ntoa(data[start + 20 : start + 24])))  # sockaddr_in: family, port, address
    return found


def parse_if_inet6(text: str) -> list[tuple[str, str]]:
    """(interface, IPv6 address) from /proc/net/if_inet6 (address hex, index, prefix, scope, flags, name)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 6 or len(fields[0]) != 32:
            continue
        try:
            found.append((fields[5], socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))))
        except ValueError:
            continue
    return found


def interface_addresses(proc_net: Path = Path("/proc/net")) -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 first). An alias label ``eth0:1`` counts as ``eth0``."""
    pairs = _ipv4_addresses()
    with contextlib.suppress(OSError):
        pairs += parse_if_inet6((proc_net / "if_inet6").read_text(errors="replace"))
    addresses: dict[str, list[str]] = {}
    for name, address in pairs:
        addresses.setdefault(name.split(":", 1)[0], []).append(address)
    return addresses


def parse_default_route(text: str) -> str | None:
    """The interface of the IPv4 default route in /proc/net/route (lowest metric), or None."""
    best: tuple[int, str] | None = None
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[1] != "00000000" or fields[7] != "00000000":
            continue
        try:
            flags, metric = int(fields[3], 16), int(fields[6])
        except ValueError:
            continue
        if flags & 0x1 and (best is None or metric < best[0]):  # RTF_UP
            best = (metric, fields[0])
    return best[1] if best else None


def source_address(destination: str) -> str:
    """The address this node sends from to reach ``destination`` (the kernel's route; nothing is sent)."""
    try:
        infos = socket.getaddrinfo(destination, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise NetworkError(f"cannot resolve the head address {destination!r} ({exc.strerror}); pass its IP") from None
    family, _, _, _, sockaddr = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            raise NetworkError(
                f"no route from {socket.gethostname()} to the head {destination} ({exc.strerror}); "
                f"check the address and this node's routes (`ip route get {destination}`)"
            ) from None
        return sock.getsockname()[0]


def interface_holding(address: str, addresses: Mapping[str, Sequence[str]]) -> str | None:
    wanted = ipaddress.ip_address(address.split("%", 1)[0])
    for name, held in addresses.items():
        for candidate in held:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(candidate.split("%", 1)[0]) == wanted:
                    return name
    return None


@dataclasses.dataclass(frozen=True)
class NodeNetwork:
    node_ip: str
    interface: str


def node_network(
    head: str,
    *,
    addresses: Callable[[], Mapping[str, Sequence[str]]] = interface_addresses,
    route_table: Path = Path("/proc/net/route"),
) -> NodeNetwork:
    """This node's address and interface towards the head. ``head="auto"``: this node is the head and
    its address is the one on the default route's interface."""
    try:
        held = addresses()
    except OSError as exc:
        raise NetworkError(f"cannot list {socket.gethostname()}'s addresses ({exc})") from None
    if head == "auto":
        try:
            interface = parse_default_route(route_table.read_text(errors="replace"))
        except OSError:
            interface = None
        ipv4 = [a for a in held.get(interface or "", []) if ":" not in a]
        if not interface or not ipv4:
            raise NetworkError(
                f"{socket.gethostname()} has no default route with an IPv4 address to take as the head's address; "
                "pass it: `ray_start.sh head NODE_IP`"
            )
        return NodeNetwork(ipv4[0], interface)
    node_ip = source_address(head)
    interface = interface_holding(node_ip, held)
    if interface is None:
        raise NetworkError(
            f"{socket.gethostname()} reaches {head} from {node_ip}, which no interface of this node holds "
            f"(interfaces: {', '.join(sorted(held)) or 'none'}); check its routes to the head (`ip route get {head}`)"
        )
    return NodeNetwork(node_ip, interface)


def node_env(network: NodeNetwork, env: Mapping[str, str]) -> dict[str, str]:
    """The variables ray_start.sh exports on this node: NODE_IP, and each *_SOCKET_IFNAME the operator left unset.

    HCCL gets the exact-match form ``=name``: a bare name is a prefix for HCCL (``eth1`` also matches ``eth10``).
    """
    exported = {"NODE_IP": network.node_ip}
    for name in IFNAME_VARIABLES:
        if not env.get(name, "").strip():
            exported[name] = f"={network.interface}" if name == "HCCL_SOCKET_IFNAME" else network.interface
    return exported


# --- HCCL_SOCKET_IFNAME ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IfnameSpec:
    """HCCL_SOCKET_IFNAME: ``eth,enp`` (prefixes), ``=eth0,enp0`` (exact), ``^eth`` / ``^=eth0`` (all but)."""

    names: tuple[str, ...]
    exact: bool
    exclude: bool

    def matches(self, interface: str) -> bool:
        return any(interface == n if self.exact else interface.startswith(n) for n in self.names)


def parse_hccl_ifname(value: str) -> IfnameSpec:
    text = value.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    text = text.removeprefix("=")
    names = tuple(n.strip() for n in text.split(","))
    if not text or any(not n for n in names):
        raise ValueError(f"HCCL_SOCKET_IFNAME={value!r} names no interface (or has an empty entry)")
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.@:-]+", n)]
    if bad:
        raise ValueError(
            f"HCCL_SOCKET_IFNAME={value!r}: {', '.join(repr(b) for b in bad)} is not an interface name; HCCL takes "
            "prefixes `eth,enp`, exact names `=eth0,enp0` or exclusions `^eth` / `^=eth0` (the `=` and `^` go first, "
            "once)"
        )
    return IfnameSpec(names, exact, exclude)


def _hccl_default_order(interfaces: Sequence[str]) -> list[str]:
    """HCCL's own preference when nothing narrows it: other interfaces by name, then docker*, then lo."""

    def rank(name: str) -> tuple[int, str]:
        if name == "lo":
            return (2, name)
        return (1 if name.startswith("docker") else 0, name)

    return sorted(interfaces, key=rank)


def hccl_interface(spec: IfnameSpec | None, interfaces: Sequence[str]) -> str | None:
    """The interface HCCL takes on a node with ``interfaces``: the first match, in the order the value lists names."""
    if spec is None:
        candidates = _hccl_default_order(interfaces)
    elif spec.exclude:
        candidates = [i for i in _hccl_default_order(interfaces) if not spec.matches(i)]
    else:
        candidates = []
        for name in spec.names:
            hits = [name] if spec.exact else sorted(i for i in interfaces if i.startswith(name))
            candidates += [i for i in hits if i in interfaces and i not in candidates]
    return candidates[0] if candidates else None


# --- interface state ---------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # carrier of an interface that is administratively down: EINVAL
        return None


def interface_state(name: str, sys_class_net: Path) -> tuple[str, str] | None:
    """(status, why) of an interface from sysfs; None when it is fine."""
    base = sys_class_net / name
    if not base.is_dir():
        return (FAIL, "does not exist")
    operstate = _read(base / "operstate") or "unreadable"
    carrier = _read(base / "carrier")
    if operstate in ("down", "lowerlayerdown", "notpresent") or (carrier is None and operstate != "up"):
        return (FAIL, f"is down (operstate {operstate})")
    if carrier == "0":
        return (FAIL, f"has no carrier (operstate {operstate}): no link on the cable or switch port")
    if operstate not in ("up", "unknown"):  # unknown: loopback and many virtual devices report no state
        return (WARN, f"is in state {operstate}")
    return None


def _interfaces(sys_class_net: Path) -> list[str]:
    try:  # directories only: the bonding driver puts a file (bonding_masters) beside the interfaces
        return sorted(p.name for p in sys_class_net.iterdir() if p.is_dir())
    except OSError:
        return []


# --- ports -------------------------------------------------------------------------------------


def tcp_port_in_use(port: int) -> bool:
    """Whether something listens on ``port`` here (a listener on any address blocks the wildcard bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def parse_port_list(value: str) -> list[tuple[int, int]]:
    """``60000-60050,61000`` -> [(60000, 60050), (61000, 61000)] (HCCL_HOST_SOCKET_PORT_RANGE's syntax).

    ASCII digits only: HCCL reads no other, though Python's int() would turn '٦٠٠٠٠' into 60000."""
    ranges = []
    for part in value.split(","):
        text = part.strip(" \t")
        match = re.fullmatch(r"([0-9]{1,5})(?:[ \t]*-[ \t]*([0-9]{1,5}))?", text)
        if not match:
            raise ValueError(f"{text!r} is not a port or a range lo-hi")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if not 1 <= low <= high <= 65535:
            raise ValueError(f"{text!r} is not within 1-65535 (low first)")
        ranges.append((low, high))
    return ranges


RAY_PORT_VARIABLES = (
    "RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_NODE_MANAGER_PORT", "RAY_OBJECT_MANAGER_PORT", "RAY_MIN_WORKER_PORT",
    "RAY_MAX_WORKER_PORT",
)  # fmt: skip


def env_port(env: Mapping[str, str], name: str) -> int | None:
    """The port in ``env[name]`` (None: unset or empty); InputError naming the variable when it is not one (ASCII
    digits, 1-65535: `ray start` would get the text as written)."""
    value = env.get(name, "")
    if not value.strip():
        return None
    return inputs.integer(name, value, minimum=1, maximum=65535)


def _env_port(env: Mapping[str, str], name: str) -> int | None:
    """The port, or None when unset or not a port (check_ray_port_variables reports that one)."""
    try:
        return env_port(env, name)
    except inputs.InputError:
        return None


def check_ray_port_variables(env: Mapping[str, str], node: str) -> list[Finding]:
    """A Ray port variable that is not a port fails here, by name, rather than being replaced by Ray's default."""
    findings = []
    for name in RAY_PORT_VARIABLES:
        try:
            env_port(env, name)
        except inputs.InputError:
            findings.append(
                Finding(
                    "network.ray_ports", FAIL, f"{name}={env[name]!r} on {node} is not a port number (1-65535)",
                    f"set {name} to a port number in ASCII digits, or unset it for Ray's default",
                )
            )  # fmt: skip
    return findings


def ray_ports(env: Mapping[str, str]) -> list[tuple[str, int, int]]:
    """(what, first, last) for the ports `ray start` binds at fixed numbers, as ray_start.sh starts it."""
    gcs = _env_port(env, "RAY_PORT") or RAY_DEFAULT_GCS_PORT
    dashboard = _env_port(env, "RAY_DASHBOARD_PORT") or RAY_DEFAULT_DASHBOARD_PORT
    low = _env_port(env, "RAY_MIN_WORKER_PORT") or RAY_DEFAULT_WORKER_PORTS[0]
    high = _env_port(env, "RAY_MAX_WORKER_PORT") or RAY_DEFAULT_WORKER_PORTS[1]
    ports = [
        ("Ray GCS (RAY_PORT)", gcs, gcs),
        ("Ray dashboard (RAY_DASHBOARD_PORT)", dashboard, dashboard),
        ("Ray client server", RAY_CLIENT_SERVER_PORT, RAY_CLIENT_SERVER_PORT),
        ("Ray dashboard agent", RAY_DASHBOARD_AGENT_LISTEN_PORT, RAY_DASHBOARD_AGENT_LISTEN_PORT),
        ("Ray worker ports (RAY_MIN_WORKER_PORT-RAY_MAX_WORKER_PORT)", low, high),
    ]
    for name, what in (
        ("RAY_NODE_MANAGER_PORT", "Ray node manager"),
        ("RAY_OBJECT_MANAGER_PORT", "Ray object manager"),
    ):
        port = _env_port(env, name)
        if port:
            ports.append((f"{what} ({name})", port, port))
    return ports


def ray_start_args(env: Mapping[str, str], role: str) -> list[str]:
    """The `ray start` options of this node: its address and the ports the network check checked."""
    args = [f"--node-ip-address={env['NODE_IP']}"] if env.get("NODE_IP") else []
    options = {
        "RAY_PORT": "--port",
        "RAY_DASHBOARD_PORT": "--dashboard-port",
        "RAY_NODE_MANAGER_PORT": "--node-manager-port",
        "RAY_OBJECT_MANAGER_PORT": "--object-manager-port",
        "RAY_MIN_WORKER_PORT": "--min-worker-port",
        "RAY_MAX_WORKER_PORT": "--max-worker-port",
    }
    for name, option in options.items():
        if name in ("RAY_PORT", "RAY_DASHBOARD_PORT") and role != "head":
            continue  # a worker reaches the GCS through --address; the dashboard runs on the head
        try:
            port = env_port(env, name)
        except inputs.InputError:
            raise NetworkError(f"{name}={env[name]!r} is not a port number (1-65535); fix it in the env file") from None
        if port is not None:
            args.append(f"{option}={port}")
    return args


def _ranges_text(ranges: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def _busy_text(ports: Sequence[int]) -> str:
    shown = ", ".join(str(p) for p in ports[:8])
    return shown + (f" and {len(ports) - 8} more" if len(ports) > 8 else "")


def _reserved_ports(proc_sys: Path) -> list[tuple[int, int]]:
    text = _read(proc_sys / "net" / "ipv4" / "ip_local_reserved_ports") or ""
    try:
        return parse_port_list(text) if text else []
    except ValueError:
        return []


def _ephemeral_range(proc_sys: Path) -> tuple[int, int] | None:
    fields = (_read(proc_sys / "net" / "ipv4" / "ip_local_port_range") or "").split()
    if len(fields) == 2 and all(re.fullmatch("[0-9]{1,5}", f) for f in fields):
        return int(fields[0]), int(fields[1])
    return None


def check_hccl_ports(
    env: Mapping[str, str], node: str, port_in_use: Callable[[int], bool], proc_sys: Path
) -> list[Finding]:
    check = "network.hccl_ports"
    explicit = env.get("HCCL_HOST_SOCKET_PORT_RANGE", "").strip(" \t")  # HCCL reads ASCII: U+3000 is not a space
    if explicit:
        source = f"HCCL_HOST_SOCKET_PORT_RANGE={explicit}"
        if explicit.lower() == "auto":
            return [Finding(check, OK, f"{source}: the OS picks HCCL's host ports on {node}")]
        try:
            ranges = parse_port_list(explicit)
        except ValueError as exc:
            return [
                Finding(
                    check,
                    FAIL,
                    f"{source} on {node}: {exc}",
                    "set it to `auto`, a port, a range `60000-60050`, or a comma list of them",
                )
            ]
    else:
        raw = env.get("HCCL_IF_BASE_PORT", "")
        base = HCCL_DEFAULT_BASE_PORT
        if raw.strip():
            low, high = HCCL_BASE_PORT_LIMITS
            try:
                base = inputs.integer("HCCL_IF_BASE_PORT", raw, minimum=low, maximum=high)
            except inputs.InputError:
                return [
                    Finding(
                        check,
                        FAIL,
                        f"HCCL_IF_BASE_PORT={raw!r} on {node} is not a port in {low}-{high}",
                        f"set HCCL_IF_BASE_PORT to an integer in {low}-{high} in ASCII digits (HCCL uses it and the "
                        f"next {HCCL_BASE_PORT_SPAN - 1})",
                    )
                ]
        source = f"HCCL_IF_BASE_PORT={base}" + ("" if raw.strip() else " (CANN's default)")
        ranges = [(base, base + HCCL_BASE_PORT_SPAN - 1)]
    findings = []
    clashes = [
        f"{what} {_ranges_text([(lo, hi)])}"
        for what, lo, hi in ray_ports(env)
        if any(lo <= r_hi and r_lo <= hi for r_lo, r_hi in ranges)
    ]
    if clashes:
        findings.append(
            Finding(
                check,
                FAIL,
                f"HCCL's host ports {_ranges_text(ranges)} ({source}) overlap {'; '.join(clashes)} on {node}",
                "move HCCL_IF_BASE_PORT (or HCCL_HOST_SOCKET_PORT_RANGE) clear of Ray's ports, or move Ray's",
            )
        )
    busy = [p for lo, hi in ranges for p in range(lo, hi + 1) if port_in_use(p)]
    if busy:
        findings.append(
            Finding(
                check,
                FAIL,
                f"HCCL's host ports in use on {node}: {_busy_text(busy)} ({source}, range {_ranges_text(ranges)})",
                f"stop what listens there (`ss -ltnp 'sport = :{busy[0]}'`) or set HCCL_IF_BASE_PORT to a free range",
            )
        )
    ephemeral = _ephemeral_range(proc_sys)
    reserved = _reserved_ports(proc_sys)
    if ephemeral is not None and any(  # a port of HCCL's in the ephemeral range, and not reserved
        ephemeral[0] <= p <= ephemeral[1] and not any(a <= p <= b for a, b in reserved)
        for lo, hi in ranges
        for p in range(lo, hi + 1)
    ):
        findings.append(
            Finding(
                check,
                WARN,
                f"HCCL's host ports {_ranges_text(ranges)} lie in {node}'s ephemeral range "
                f"{ephemeral[0]}-{ephemeral[1]} unreserved: an outgoing connection can take one first",
                f"sysctl -w net.ipv4.ip_local_reserved_ports={_ranges_text(ranges)}",
            )
        )
    if not findings:
        findings.append(Finding(check, OK, f"{_ranges_text(ranges)} free on {node}, clear of Ray's ports ({source})"))
    return findings


def check_ray_ports_free(env: Mapping[str, str], node: str, port_in_use: Callable[[int], bool]) -> list[Finding]:
    """On the head before `ray start`: the GCS and dashboard ports must be free."""
    fixed = {
        "Ray GCS (RAY_PORT)": _env_port(env, "RAY_PORT") or RAY_DEFAULT_GCS_PORT,
        "Ray dashboard (RAY_DASHBOARD_PORT)": _env_port(env, "RAY_DASHBOARD_PORT") or RAY_DEFAULT_DASHBOARD_PORT,
    }
    busy = [f"{what} {port}" for what, port in fixed.items() if port_in_use(port)]
    if busy:
        return [
            Finding(
                "network.ray_ports",
                FAIL,
                f"in use on {node}: {'; '.join(busy)}",
                "a Ray from an earlier start may still run: `ray stop`; or set another port in the env file",
            )
        ]
    return [Finding("network.ray_ports", OK, f"Ray's GCS and dashboard ports are free on {node}")]


# --- hccn_tool ---------------------------------------------------------------------------------


def parse_hccn_ip(text: str) -> str | None:
    """The device IP in `hccn_tool -i N -ip -g` output (an ``ipaddr:ADDRESS`` line), or None."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "ipaddr":
            with contextlib.suppress(ValueError):
                return str(ipaddress.ip_address(value.strip()))
    return None


def parse_hccn_link(text: str) -> str | None:
    """UP / DOWN from `hccn_tool -i N -link -g` output (a ``link status: UP`` line), or None."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and " ".join(key.lower().split()) == "link status" and value.strip().upper() in ("UP", "DOWN"):
            return value.strip().upper()
    return None


def npu_ids(dev: Path) -> list[int]:
    """Physical ids of the NPUs this node (or container) has, from /dev/davinciN."""
    ids = []
    with contextlib.suppress(OSError):
        for path in dev.iterdir():
            match = re.fullmatch(r"davinci([0-9]+)", path.name)
            if match:
                ids.append(int(match.group(1)))
    return sorted(ids)


def _find_hccn_tool(env: Mapping[str, str]) -> str | None:
    search = os.pathsep.join([env.get("PATH", os.defpath), *HCCN_TOOL_DIRS])
    return shutil.which("hccn_tool", path=search)


def check_npu_nics(
    env: Mapping[str, str], node: str, run: Callable[..., CommandResult | None], dev: Path
) -> list[Finding]:
    devices = npu_ids(dev)
    if not devices:
        return [Finding("network.npu_nic", OK, f"no NPU on {node} (no {dev}/davinciN): no device NIC to check")]
    tool = _find_hccn_tool(env)
    if tool is None:
        return [
            Finding(
                "network.npu_nic",
                OK,
                f"hccn_tool not found on {node} (PATH, {', '.join(HCCN_TOOL_DIRS)}): device NIC checks skipped",
            )
        ]
    no_ip: list[str] = []
    unreadable: list[str] = []
    addresses: dict[str, list[int]] = {}
    down: list[int] = []
    unknown: list[str] = []
    for device in devices:
        result = run([tool, "-i", str(device), "-ip", "-g"], timeout=COMMAND_TIMEOUT_S)
        problem = _command_problem(result)
        if problem:
            unreadable.append(f"npu {device} -ip: {problem}")
        else:
            assert result is not None  # _command_problem names a missing result
            address = parse_hccn_ip(result.output)
            if address is None:
                no_ip.append(f"npu {device} ({_excerpt(result.output, 60)})")
            else:
                addresses.setdefault(address, []).append(device)
        result = run([tool, "-i", str(device), "-link", "-g"], timeout=COMMAND_TIMEOUT_S)
        problem = _command_problem(result)
        if problem:
            unreadable.append(f"npu {device} -link: {problem}")
            continue
        assert result is not None  # _command_problem names a missing result
        state = parse_hccn_link(result.output)
        if state == "DOWN":
            down.append(device)
        elif state is None:
            unknown.append(f"npu {device} ({_excerpt(result.output, 60)})")
    findings = []
    if no_ip:
        findings.append(
            Finding(
                "network.npu_ip",
                FAIL,
                f"no device IP on {node} for {'; '.join(no_ip)}",
                "set it in /etc/hccn.conf (or `hccn_tool -i N -ip -s address ADDR netmask MASK`) as root",
            )
        )
    shared = {a: d for a, d in addresses.items() if len(d) > 1}
    if shared:
        listing = "; ".join(f"{a} on npus {', '.join(map(str, d))}" for a, d in sorted(shared.items()))
        findings.append(
            Finding("network.npu_ip", FAIL, f"device IPs repeat on {node}: {listing}", "give each NPU its own IP")
        )
    if down:
        findings.append(
            Finding(
                "network.npu_link",
                FAIL,
                f"device NIC link DOWN on {node}: npu {', '.join(map(str, down))}",
                "check those NPUs' optical modules, cables and switch ports (`hccn_tool -i N -link -g`, "
                "`hccn_tool -i N -net_health -g`)",
            )
        )
    if unknown:
        findings.append(
            Finding(
                "network.npu_link",
                WARN,
                f"unrecognised `hccn_tool -link -g` output on {node}: {'; '.join(unknown)}",
                "run `hccn_tool -i N -link -g` by hand; expected a `link status: UP` line",
            )
        )
    if unreadable:
        findings.append(
            Finding(
                "network.npu_nic",
                WARN,
                f"hccn_tool could not be queried on {node}: {'; '.join(unreadable[:4])}"
                + (f" and {len(unreadable) - 4} more" if len(unreadable) > 4 else ""),
                "run it as root with the driver loaded (`npu-smi info` must list the NPUs)",
            )
        )
    if not findings:
        findings.append(
            Finding("network.npu_nic", OK, f"{len(devices)} NPUs on {node}: device IPs set, links UP ({tool})")
        )
    return findings


def _command_problem(result: CommandResult | None) -> str | None:
    if result is None:
        return "could not be executed"
    if result.returncode is None:
        return f"no answer within {COMMAND_TIMEOUT_S:.0f} s"
    if result.returncode != 0:
        return f"exit {result.returncode}: {_excerpt(result.output, 80)}"
    return None


# --- the check ---------------------------------------------------------------------------------


def _check_hccl_ifname(
    env: Mapping[str, str], node: str, present: Sequence[str], state: _InterfaceLookup
) -> list[Finding]:
    check = "network.hccl_ifname"
    value = env.get("HCCL_SOCKET_IFNAME", "").strip()
    spec = None
    if value:
        try:
            spec = parse_hccl_ifname(value)
        except ValueError as exc:
            return [Finding(check, FAIL, f"{exc} (on {node})", "write it as `=eth0`, `eth`, `^docker` or `^=lo`")]
    shown = f"HCCL_SOCKET_IFNAME={value}" if value else "HCCL_SOCKET_IFNAME unset"
    chosen = hccl_interface(spec, present)
    if chosen is None:
        return [
            Finding(
                check,
                FAIL,
                f"{shown}: no interface on {node} matches (interfaces: {', '.join(present) or 'none'})",
                "name an interface of this node; nodes that name theirs differently need their own value "
                "(ray_start.sh sets it per node when the env file leaves it unset)",
            )
        ]
    findings = state.findings(check, shown, chosen)
    if not value and findings[-1].status == OK:
        findings[-1] = Finding(
            check,
            WARN,
            f"{shown}: HCCL picks {chosen} on {node} by its own order (others by name, then docker, then lo)",
            "ray_start.sh sets it per node to the interface that routes to the head; or set it: "
            "HCCL_SOCKET_IFNAME==eth0",
        )
    return findings


def _check_plain_ifname(
    variable: str, env: Mapping[str, str], node: str, present: Sequence[str], state: _InterfaceLookup
) -> list[Finding]:
    """GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME: plain interface names, comma separated."""
    check = f"network.{variable.split('_', 1)[0].lower()}_ifname"
    value = env.get(variable, "").strip()
    if not value:
        if variable != "GLOO_SOCKET_IFNAME":
            return []
        return [
            Finding(
                check,
                WARN,
                f"GLOO_SOCKET_IFNAME unset on {node}: Gloo takes the address {node} resolves to, which may not "
                "reach the other nodes",
                "ray_start.sh sets it per node to the interface that routes to the head; or set it: "
                "GLOO_SOCKET_IFNAME=eth0",
            )
        ]
    shown = f"{variable}={value}"
    findings = []
    for name in (n.strip() for n in value.split(",")):
        if not re.fullmatch(r"[A-Za-z0-9_.@:-]+", name):
            findings.append(
                Finding(
                    check,
                    FAIL,
                    f"{shown} on {node}: {name!r} is not an interface name (it takes plain names, comma separated)",
                    "write it as `eth0` (no `=` or `^`: those are HCCL_SOCKET_IFNAME's syntax)",
                )
            )
        elif name not in present:
            findings.append(
                Finding(
                    check,
                    FAIL,
                    f"{shown}: interface {name} does not exist on {node} (interfaces: {', '.join(present) or 'none'})",
                    "name an interface of this node (ray_start.sh sets it per node when the env file leaves it unset)",
                )
            )
        else:
            findings += state.findings(check, shown, name)
    return findings


def _check_hccl_if_ip(env: Mapping[str, str], node: str, held: Mapping[str, Sequence[str]]) -> list[Finding]:
    value = env.get("HCCL_IF_IP", "").strip()
    if not value:
        return []
    try:
        owner = interface_holding(value, held)
    except ValueError:
        owner = None
    if owner is None:
        return [
            Finding(
                "network.hccl_if_ip",
                FAIL,
                f"HCCL_IF_IP={value} is not an address of {node} (it overrides HCCL_SOCKET_IFNAME)",
                "unset HCCL_IF_IP (HCCL_SOCKET_IFNAME is set per node), or set it per node to that node's address",
            )
        ]
    return [Finding("network.hccl_if_ip", OK, f"HCCL_IF_IP={value} is on {owner} of {node}")]


@dataclasses.dataclass(frozen=True)
class _InterfaceLookup:
    """What the ifname checks need to know about this node's interfaces."""

    node: str
    sys_class_net: Path
    held: Mapping[str, Sequence[str]]
    head_interface: str | None

    def findings(self, check: str, shown: str, name: str) -> list[Finding]:
        state = interface_state(name, self.sys_class_net)
        if state is not None:
            status, why = state
            return [
                Finding(
                    check,
                    status,
                    f"{shown}: interface {name} on {self.node} {why}",
                    f"bring it up (`ip link set {name} up`, check its cable) or name another interface",
                )
            ]
        addresses = self.held.get(name, [])
        if not addresses:
            return [
                Finding(
                    check,
                    FAIL,
                    f"{shown}: interface {name} on {self.node} has no IP address",
                    f"give {name} an address or name the interface that carries this node's IP",
                )
            ]
        if self.head_interface and name != self.head_interface:
            return [
                Finding(
                    check,
                    WARN,
                    f"{shown}: {name} on {self.node}, but this node reaches the head through {self.head_interface}",
                    f"use {self.head_interface} unless {name}'s network reaches every node",
                )
            ]
        return [Finding(check, OK, f"{shown}: {name} on {self.node} is up ({addresses[0]})")]


def check_network(
    env: Mapping[str, str],
    *,
    run: Callable[..., CommandResult | None] = run_command,
    sys_class_net: Path = Path("/sys/class/net"),
    port_in_use: Callable[[int], bool] = tcp_port_in_use,
    node: str = socket.gethostname(),
    proc_sys: Path = Path("/proc/sys"),
    dev: Path = Path("/dev"),
    addresses: Callable[[], Mapping[str, Sequence[str]]] = interface_addresses,
    head: str | None = None,
    role: str | None = None,
) -> list[Finding]:
    """Every ``network.*`` finding for this node. ``head``: the Ray head's address (adds the route
    check); ``role="head"`` before `ray start` on the head (adds: Ray's own ports are free)."""
    findings = []
    head_interface = None
    if head:
        try:
            here = node_network(head, addresses=addresses)
        except NetworkError as exc:
            findings.append(Finding("network.route_to_head", FAIL, str(exc), "fix the route or the head's address"))
        else:
            head_interface = here.interface
            findings.append(
                Finding(
                    "network.route_to_head",
                    OK,
                    f"{node} reaches the head {head} from {here.node_ip} ({here.interface})",
                )
            )
    try:
        held = addresses()
    except OSError:
        held = {}
    present = _interfaces(sys_class_net)
    lookup = _InterfaceLookup(node, sys_class_net, held, head_interface)
    findings += _check_hccl_ifname(env, node, present, lookup)
    findings += _check_plain_ifname("GLOO_SOCKET_IFNAME", env, node, present, lookup)
    findings += _check_plain_ifname("TP_SOCKET_IFNAME", env, node, present, lookup)
    findings += _check_hccl_if_ip(env, node, held)
    findings += check_hccl_ports(env, node, port_in_use, proc_sys)
    findings += check_ray_port_variables(env, node)
    if role == "head":
        findings += check_ray_ports_free(env, node, port_in_use)
    findings += check_npu_nics(env, node, run, dev)
    return findings


# --- command line ------------------------------------------------------------------------------


def _print_findings(findings: Sequence[Finding]) -> None:
    for f in findings:
        print(f"[{f.status.upper():4}] {f.check}: {f.detail}")
        if f.fix and f.status != OK:
            print(f"       fix: {f.fix}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m verl_npu.cluster.network", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env_cmd = sub.add_parser("node-env", help="print NODE_IP and the *_SOCKET_IFNAME this node should export")
    env_cmd.add_argument("--head", required=True, help="the Ray head's address; `auto` on the head itself")
    check_cmd = sub.add_parser("check", help="print this node's network findings; exit 1 on a failure")
    check_cmd.add_argument("--head", help="the Ray head's address (checks the route to it)")
    check_cmd.add_argument("--role", choices=("head", "worker"), help="before `ray start` (head: Ray's ports free)")
    args_cmd = sub.add_parser("ray-args", help="print this node's `ray start` options, one a line")
    args_cmd.add_argument("--role", choices=("head", "worker"), required=True)
    args = parser.parse_args(argv)
    env = dict(os.environ)
    try:
        if args.command == "node-env":
            for name, value in node_env(node_network(args.head), env).items():
                print(f"{name}={value}")
            return 0
        if args.command == "ray-args":
            print("\n".join(ray_start_args(env, args.role)))
            return 0
    except NetworkError as exc:
        print(f"network: {exc}", file=sys.stderr)
        return 2
    findings = check_network(env, head=args.head, role=args.role)
    _print_findings(findings)
    failed = [f for f in findings if f.status == FAIL]
    if failed:
        print(f"network: {len(failed)} failure(s) on {socket.gethostname()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
