"""Hostile input to the env file and `verl-npu k8s` (issue 29, classes 6 and 7).

Properties:
- env file lines built from bash's quoting and expansion characters: the reader refuses the line, or bash's
  `set -a; source` sets exactly the value the reader returns (bash is the oracle);
- any value: :func:`verl_npu.envfile.assignment_text` refuses it, or bash and the reader both read it back;
- a render with hostile --env values and node counts: exit 0 or 2, never more node pods than --max-nodes, and on
  exit 0 the ConfigMap's env file (after a YAML round trip) reads back, in bash and in the reader, as the values
  the pods get;
- `k8s validate` on arbitrary text and on manifests with any replica counts: exit 0, 1 or 2 at once, and exit 1
  whenever the node pods exceed --max-nodes.
"""

from __future__ import annotations

import string
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

pytest.importorskip("referencing", reason="the schema validator's reference resolver; not installed here")

import yaml

from verl_npu.ci.images import image_tag
from verl_npu.envfile import EnvFileError, assignment_text, parse_env_text
from verl_npu.k8s import validate

BASH_SPECIAL = "$`\\'\"~{}*?[]#!;&|<>() \t=:,@%+-./^"
VALUE_CHARS = st.sampled_from(list(BASH_SPECIAL) + list("aZ09_") + ["é", "\u00a0", "\r", "\x0b", "\x85", "\u2028"])
IMAGE = image_tag("a3", "0123456789abcdef0123456789abcdef01234567", registry="registry.example/team")
LAUNCH = "examples/glm5_2/run_glm5_2_grpo_a3.sh"
BASE_ENV = "MODEL_PATH=/root/.cache/models/m\nNPUS_PER_NODE=16\nHCCL_BUFFSIZE=400\n"


def sourced(text: str, names: list[str]) -> list[str]:
    """The values bash's `set -a; source` gives ``names`` from env file ``text`` (in an empty environment)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "f.env"
        path.write_text(text)
        script = 'set -a; source "$1" >/dev/null 2>&1; shift; for n in "$@"; do printf "%s\\0" "${!n-<unset>}"; done'
        done = subprocess.run(
            ["env", "-i", "HOME=/home/someone", "PATH=/usr/bin:/bin", "bash", "-c", script, "-", str(path), *names],
            capture_output=True, check=True, cwd=directory, timeout=10,
        )  # fmt: skip
    return done.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1]


@st.composite
def value_texts(draw) -> str:
    """What follows NAME= on a line: bare, or wrapped in quotes, from characters bash treats specially."""
    body = draw(st.text(VALUE_CHARS, max_size=10))
    quote = draw(st.sampled_from(["", "", "'", '"']))
    return f"{quote}{body}{quote}"


@given(st.lists(value_texts(), min_size=1, max_size=6), st.booleans())
def test_an_accepted_env_line_is_what_bash_sources(texts, export):
    lines, accepted = [], []
    for index, text in enumerate(texts):
        line = f"{'export ' if export else ''}K{index}={text}"
        try:
            value = parse_env_text(line + "\n", "f.env").variables[f"K{index}"]
        except EnvFileError:
            continue
        lines.append(line)
        accepted.append((f"K{index}", value))
    event(f"{len(accepted)} of {len(texts)} lines accepted")
    if accepted:
        got = sourced("\n".join(lines) + "\n", [name for name, _ in accepted])
        assert got == [value for _, value in accepted], lines


@given(st.text(st.characters(codec="utf-8"), max_size=20))
def test_assignment_text_reads_back_in_bash_and_the_reader(value):
    try:
        line = assignment_text("W", value)
    except EnvFileError:
        return
    assert parse_env_text(line + "\n", "w.env").variables == {"W": value}
    assert sourced(line + "\n", ["W"]) == [value]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("render")


ENV_CHARS = [*"aZ9/._-:= $`\\'\"~{},*\t", "é", "\n", "\r", "\x1b", "\x85"]
ENV_VALUES = st.text(st.sampled_from(ENV_CHARS), max_size=12)


@given(
    st.dictionaries(st.sampled_from(["EXTRA", "HCCL_BUFFSIZE", "DSA_NOTE", "X_1"]), ENV_VALUES, max_size=3),
    st.one_of(st.integers(min_value=1, max_value=64), st.integers(min_value=-5, max_value=10**7)),
    st.integers(min_value=1, max_value=40),
)
def test_a_render_writes_env_values_bash_and_the_pods_read_alike_and_no_more_nodes_than_allowed(
    run_cli, workdir, env_values, nnodes, max_nodes
):
    env_path = workdir / "cluster.env"
    env_path.write_text(BASE_ENV + f"NNODES={nnodes}\n")
    out = workdir / "out.yaml"
    out.unlink(missing_ok=True)
    code, _, err = run_cli(
        "k8s", "render", "rayjob", "--name", "verl-npu-fuzz-1", "--launch", LAUNCH, "--env-file", str(env_path),
        "--image", IMAGE, "--no-preflight", "--max-nodes", str(max_nodes), "-o", str(out),
        *(f"--env={k}={v}" for k, v in env_values.items()),
    )  # fmt: skip
    assert code in (0, 2), err
    event(f"render exit {code}")
    if not 1 <= nnodes <= max_nodes:
        assert code == 2, err
    if code == 2:
        assert not out.exists()
        return
    docs = list(yaml.safe_load_all(out.read_text()))
    cluster = docs[1]["spec"]["rayClusterSpec"]
    assert 1 + sum(g["replicas"] for g in cluster.get("workerGroupSpecs", [])) == nnodes
    pods = {e["name"]: e["value"] for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    text = docs[0]["data"]["cluster.env"]
    ours = parse_env_text(text, "cluster.env").variables
    names = sorted(ours)
    assert sourced(text, names) == [ours[n] for n in names]
    for key, value in env_values.items():
        assert ours[key] == pods[key] == value


YAML_PIECES = st.sampled_from([*string.printable, "&a ", "*a", "- ", ": ", "kind: RayJob\n", "replicas: ", "é"])


@given(st.lists(YAML_PIECES, max_size=80).map("".join))
def test_validate_answers_arbitrary_text_at_once(run_cli, workdir, text):
    path = workdir / "m.yaml"
    path.write_text(text)
    started = time.monotonic()
    code, _, err = run_cli("k8s", "validate", str(path))
    assert time.monotonic() - started < 10
    assert code in (1, 2), err  # arbitrary text is never a valid manifest


HEAD = {"name": "h", "image": "i:1"}


@given(st.lists(st.integers(min_value=-3, max_value=10**9), min_size=1, max_size=3), st.integers(1, 10**6))
def test_validate_flags_every_manifest_with_more_node_pods_than_allowed(replicas, max_nodes):
    groups = [
        {"groupName": f"g{i}", "replicas": r, "minReplicas": max(r, 0), "maxReplicas": max(r, 0),
         "rayStartParams": {}, "template": {"spec": {"containers": [{"name": "w", "image": "i:1"}]}}}
        for i, r in enumerate(replicas)
    ]  # fmt: skip
    doc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "j"},
        "spec": {
            "entrypoint": "true",
            "rayClusterSpec": {
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [HEAD]}}},
                "workerGroupSpecs": groups,
            },
        },
    }
    problems = [str(p) for p in validate.validate_document(doc, "m.yaml #1", max_nodes)]
    pods = 1 + sum(max(r, 0) for r in replicas)
    flagged = any("node pods, more than --max-nodes" in p for p in problems)
    assert flagged == (pods > max_nodes), problems
