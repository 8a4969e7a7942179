"""Hostile input to `verl-npu k8s` (issue 29): readers with bounds, values read again by bash or YAML, node counts.

- `k8s validate` refuses at once (exit 2, naming the path and its kind) what is not a regular file or is too large,
  and YAML that would make the validator's work explode (aliases, deep nesting);
- the env file the head sources and the values the pods get are the same text (bash is the oracle);
- a render never writes more node pods than --max-nodes (default: Kubernetes' 5,000-node cluster limit), and
  `k8s validate` applies the same bound to a manifest.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("referencing", reason="the schema validator's reference resolver; not installed here")

import yaml

from verl_npu.ci.images import image_tag
from verl_npu.cli import main
from verl_npu.envfile import env_file_variables
from verl_npu.k8s import defaults, render, validate

COMMIT = "0123456789abcdef0123456789abcdef01234567"
IMAGE = image_tag("a3", COMMIT, registry="registry.example/team")
LAUNCH = "examples/glm5_2/run_glm5_2_grpo_a3.sh"
ENV = """\
MODEL_PATH=/root/.cache/models/zai-org/GLM-5.2
CKPT_DIR=/root/.cache/checkpoints/glm5_2
NNODES=4
NPUS_PER_NODE=16
HCCL_BUFFSIZE=400
"""


@pytest.fixture
def quick():
    """Fails the test instead of hanging it: every refusal here must come at once."""

    def expire(*_):
        raise TimeoutError("the command did not return within 20 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def render_argv(tmp_path: Path, env_text: str, *args: str, kind: str = "rayjob") -> tuple[list[str], Path]:
    env_path = tmp_path / "cluster.env"
    env_path.write_text(env_text)
    out = tmp_path / "out.yaml"
    argv = ["k8s", "render", kind, "--name", "verl-npu-test-1", "--launch", LAUNCH, "--env-file", str(env_path),
            "--image", IMAGE, "--no-preflight", "-o", str(out), *args]  # fmt: skip
    return argv, out


def refused(tmp_path: Path, capsys, env_text: str, *args: str) -> str:
    argv, out = render_argv(tmp_path, env_text, *args)
    assert main(argv) == 2
    assert not out.exists()
    return capsys.readouterr().err


def rendered(tmp_path: Path, env_text: str, *args: str, kind: str = "rayjob") -> list[dict]:
    argv, out = render_argv(tmp_path, env_text, *args, kind=kind)
    assert main(argv) == 0
    return list(yaml.safe_load_all(out.read_text()))


# --- class 6: k8s validate reads with bounds ---------------------------------------------------------------


def test_validate_refuses_what_is_not_a_regular_file_at_once_naming_its_kind(tmp_path, capsys, quick):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # no writer: a plain open() would block for ever
    sparse = tmp_path / "huge.yaml"
    with sparse.open("wb") as handle:
        handle.truncate(validate.MAX_MANIFEST_BYTES + 1)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock.yaml"))
    cases = [
        ("/dev/zero", "not a regular file but a character device"),
        (str(fifo), "not a regular file but a FIFO"),
        (str(tmp_path), "not a regular file but a directory"),
        (str(sparse), "larger than 4 MiB"),
        (str(tmp_path / "sock.yaml"), "not a regular file but a socket"),
        (str(tmp_path / "missing.yaml"), "No such file or directory"),
    ]
    with server:
        for path, expected in cases:
            started = time.monotonic()
            assert main(["k8s", "validate", path]) == 2, path
            err = capsys.readouterr().err
            assert f"verl-npu k8s validate: {path}: cannot read: {expected}" in err, err
            assert time.monotonic() - started < 5, path


def test_validate_refuses_yaml_aliases_and_deep_nesting_at_once(tmp_path, capsys, quick):
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    cases = [
        ("\n".join(bomb) + "\n", "line 2: a YAML alias"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "line 1: nested more than 64 levels deep"),
        ("x: " + "{a: " * 100 + "1" + "}" * 100 + "\n", "line 1: nested more than 64 levels deep"),
    ]
    path = tmp_path / "m.yaml"
    for text, expected in cases:
        path.write_text(text)
        started = time.monotonic()
        assert main(["k8s", "validate", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path}: {expected}" in err and "Traceback" not in err, err
        assert time.monotonic() - started < 5


def test_validate_refuses_a_key_given_twice_in_one_mapping(tmp_path, capsys):
    """PyYAML keeps the second value silently: a manifest with `replicas` twice was judged on one of the two."""
    path = tmp_path / "m.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n  name: b\ndata: {}\n")
    assert main(["k8s", "validate", str(path)]) == 2
    assert f"{path}: line 5: key 'name' is given twice in one mapping" in capsys.readouterr().err


# --- class 7: the node count -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", render.KINDS)
def test_a_node_count_beyond_max_nodes_is_refused_naming_nnodes_the_bound_and_the_option(tmp_path, capsys, kind):
    err = refused(tmp_path, capsys, ENV.replace("NNODES=4", "NNODES=1000000"))
    assert "NNODES=1000000 (" in err and "more than --max-nodes 5000" in err and "pass --max-nodes" in err, err
    err = refused(tmp_path, capsys, ENV.replace("NNODES=4", "NNODES=33"), "--max-nodes", "32")
    assert "NNODES=33 (" in err and "more than --max-nodes 32" in err, err
    docs = rendered(tmp_path, ENV.replace("NNODES=4", "NNODES=32"), "--max-nodes", "32", kind=kind)
    assert validate.validate_documents(docs, "t", max_nodes=32) == []


def test_the_default_bound_allows_the_glm5_2_example_and_kubernetes_largest_cluster(tmp_path):
    assert int(env_file_variables("examples/glm5_2/glm5_2.env")["NNODES"]) == 32 <= defaults.DEFAULT_MAX_NODES
    docs = rendered(tmp_path, ENV.replace("NNODES=4", f"NNODES={defaults.DEFAULT_MAX_NODES}"))
    (group,) = docs[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == defaults.DEFAULT_MAX_NODES - 1


def test_validate_applies_the_bound_to_the_replicas_of_a_manifest(tmp_path, capsys):
    rayjob = rendered(tmp_path, ENV)
    volcano = rendered(tmp_path, ENV, kind="volcano")
    path = tmp_path / "m.yaml"
    path.write_text(render.dump(rayjob))
    assert main(["k8s", "validate", str(path)]) == 0
    assert main(["k8s", "validate", "--max-nodes", "3", str(path)]) == 1
    assert "spec.rayClusterSpec.workerGroupSpecs: 4 node pods, more than --max-nodes 3" in capsys.readouterr().err
    huge = copy.deepcopy(rayjob)
    group = huge[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replicas"] = group["minReplicas"] = group["maxReplicas"] = 999_999
    path.write_text(render.dump(huge))
    assert main(["k8s", "validate", str(path)]) == 1
    assert "1000000 node pods, more than --max-nodes 5000" in capsys.readouterr().err
    huge = copy.deepcopy(volcano)
    huge[1]["spec"]["tasks"][1]["replicas"] = 999_999
    huge[1]["spec"]["minAvailable"] = 1_000_000
    path.write_text(render.dump(huge))
    assert main(["k8s", "validate", str(path)]) == 1
    assert "spec.tasks: 1000000 node pods, more than --max-nodes 5000" in capsys.readouterr().err


# --- class 7: values read again by bash or YAML -------------------------------------------------------------


def test_an_env_file_value_with_an_expansion_is_refused_naming_line_and_key(tmp_path, capsys):
    err = refused(tmp_path, capsys, ENV + "CKPT2=$CKPT_DIR/x\n")
    assert "cluster.env:6: CKPT2: '$' starts an expansion" in err, err
    err = refused(tmp_path, capsys, ENV + "HCCL_BUFFSIZE=800\n")
    assert "cluster.env:6: HCCL_BUFFSIZE is set again (first on line 5)" in err, err
    err = refused(tmp_path, capsys, ENV.replace("\n", "\r\n"))
    assert "cluster.env:1: '\\r' (U+000D) is not printable" in err, err


def test_an_env_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, capsys, quick):
    argv, out = render_argv(tmp_path, ENV)
    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo)
    argv[argv.index("--env-file") + 1] = str(fifo)
    assert main(argv) == 2 and not out.exists()
    assert f"--env-file {fifo}: cannot read: not a regular file but a FIFO" in capsys.readouterr().err


def sourced_by_bash(text: str, tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "sourced.env"
    path.write_text(text)
    dump = subprocess.run(
        ["env", "-i", "HOME=/home/someone", "PATH=/usr/bin:/bin", "bash", "-c", 'set -a; source "$1"; env -0', "-",
         str(path)], capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(item.split("=", 1) for item in dump.stdout.split("\0") if "=" in item)


def test_env_values_given_as_options_reach_bash_and_the_pods_as_the_same_text(tmp_path):
    values = {"DOLLAR": "$HOME/x", "TICKS": "`id`", "SPACES": "a b  c", "TILDE": "~/ckpt", "HCCL_BUFFSIZE": "800"}
    docs = rendered(tmp_path, ENV, *(f"--env={k}={v}" for k, v in values.items()))
    text = docs[0]["data"]["cluster.env"]
    assert "# HCCL_BUFFSIZE=400  (replaced by --env HCCL_BUFFSIZE, below)" in text
    copy_path = tmp_path / "copy.env"
    copy_path.write_text(text)
    ours = env_file_variables(str(copy_path))
    bash = sourced_by_bash(text, tmp_path)
    pods = {e["name"]: e["value"] for e in docs[1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["env"]}  # fmt: skip
    for key, value in values.items():
        assert ours[key] == bash[key] == pods[key] == value, key


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--env", "Q=it's"], "--env Q: the value holds both a single quote and characters that need quoting"),
        (["--env", "N=a\nb"], "--env N: the value holds '\\n' (U+000A), a character that is not printable"),
        (["--env", "E=\x1b[31m"], "--env E: the value holds '\\x1b' (U+001B)"),
        (["--pvc", "verl-npu-cache=/root/.cache\nx"], "--pvc 'verl-npu-cache=/root/.cache\\nx': holds '\\n'"),
        (["--host-file", "/usr/local/bin/npu-smi\r"], "--host-file '/usr/local/bin/npu-smi\\r': holds '\\r'"),
        (["--", "trainer.total_epochs=1\x85"], "launch argument 'trainer.total_epochs=1\\x85': holds '\\x85'"),
    ],
)
def test_values_bash_or_yaml_would_read_otherwise_are_refused(tmp_path, capsys, args, expected):
    assert expected in refused(tmp_path, capsys, ENV, *args)


def test_max_nodes_itself_is_bounded_by_the_pod_hostnames_room(tmp_path, capsys):
    argv, _ = render_argv(tmp_path, ENV, "--max-nodes", str(defaults.MAX_NODES_LIMIT + 1))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-nodes:" in err and "100001" in err and "expected an integer from 1 to 100000" in err, err
