"""Static reading of bash launch scripts: the trainer's overrides as bash would pass them, and launch bugs."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("tree_sitter_bash", reason="the launch reader parses bash with tree-sitter; not installed here")

from support.paths import REPO as REPO_ROOT

from verl_npu.preflight.launch import (
    Finding,
    Launch,
    LaunchError,
    launch_from_overrides,
    read_launch_script,
)

TRAINER = "python3 -m verl.trainer.main_ppo"


def read(tmp_path: Path, body: str, args=(), env=None, name: str = "run.sh") -> Launch:
    script = tmp_path / name
    script.write_text(textwrap.dedent(body).lstrip("\n"))
    return read_launch_script(script, args, env)


def codes(launch: Launch) -> list[str]:
    return [f.code for f in launch.findings]


def only(launch: Launch, code: str) -> Finding:
    found = [f for f in launch.findings if f.code == code]
    assert len(found) == 1, launch.findings
    return found[0]


def test_default_used_when_unset_and_env_overrides_it(tmp_path):
    body = f"""
        NNODES=${{NNODES:-4}}
        {TRAINER} trainer.nnodes=$NNODES trainer.n_gpus_per_node=${{NPUS-16}}
    """
    assert read(tmp_path, body).overrides == ("trainer.nnodes=4", "trainer.n_gpus_per_node=16")
    launch = read(tmp_path, body, env={"NNODES": "8", "NPUS": "2"})
    assert launch.overrides == ("trainer.nnodes=8", "trainer.n_gpus_per_node=2")
    assert launch.findings == ()
    assert launch.variables["NNODES"] == "8"


def test_arithmetic(tmp_path):
    launch = read(
        tmp_path,
        f"""
        A=3 B=4
        {TRAINER} x=$((A * B + 1)) y=$(( (A + B) * 2 - 10 / 3 % 2 )) z=$((-7 / 2)) w=$(( ${{A}} ** 2 ))
        """,
    )
    assert launch.overrides == ("x=13", "y=13", "z=-3", "w=9")


def test_arrays(tmp_path):
    launch = read(
        tmp_path,
        f"""
        ARGS=(a=1 "b=two words")
        ARGS+=(c=3)
        ARGS[0]=a=0
        EMPTY=()
        {TRAINER} "${{ARGS[@]}}" "${{EMPTY[@]}}" first=${{ARGS[0]}} n=${{#ARGS[@]}} "all=${{ARGS[*]}}" $ARGS
        """,
    )
    assert launch.overrides == ("a=0", "b=two words", "c=3", "first=a=0", "n=3", "all=a=0 b=two words c=3", "a=0")


def test_line_continuations_and_comments(tmp_path):
    launch = read(
        tmp_path,
        f"""
        # a comment with python3 -m verl.trainer.main_ppo in it
        {TRAINER} \\
            a=1 \\
            b=2  \\
            c=3  # trailing comment
        """,
    )
    assert launch.overrides == ("a=1", "b=2", "c=3")
    assert launch.trainer_line == 2


def test_extra_args_keep_their_position(tmp_path):
    body = f"""
        {TRAINER} --config-name=ppo_trainer a=1 "$@" z=26
    """
    launch = read(tmp_path, body, args=["b=2", "c=with space"])
    assert launch.overrides == ("a=1", "b=2", "c=with space", "z=26")
    assert launch.passthrough == ("b=2", "c=with space")
    assert launch.config_name == "ppo_trainer"
    assert read(tmp_path, body).overrides == ("a=1", "z=26")


def test_positional_parameters_and_shift(tmp_path):
    launch = read(
        tmp_path,
        f"""
        MODEL=$1
        N=$#
        shift
        {TRAINER} model=$MODEL n=$N "$@"
        """,
        args=["/models/x", "b=2"],
    )
    assert launch.overrides == ("model=/models/x", "n=2", "b=2")
    assert launch.passthrough == ("b=2",)


def test_args_piped_to_tee(tmp_path):
    launch = read(
        tmp_path,
        f"""
        set -euo pipefail
        {TRAINER} \\
            a=1 \\
            2>&1 | tee train.log "$@"
        """,
        args=["b=2"],
    )
    finding = only(launch, "args-to-tee")
    assert finding.severity == "error"
    assert finding.line == 4
    assert '"$@" is passed to tee (line 4), not to the trainer: move it before the pipe' in finding.message
    assert launch.overrides == ("a=1",)
    assert launch.passthrough == ()


def test_args_after_trainer_on_same_line(tmp_path):
    launch = read(tmp_path, f'{TRAINER} a=1 && echo done $*\n{TRAINER} b=1 "$@" | tee log\n', args=["c=3"])
    finding = only(launch, "args-to-tee")
    assert finding.line == 1
    assert "$* is passed to echo (line 1), not to the trainer: move it into the trainer command" in finding.message
    assert launch.overrides == ("b=1", "c=3")  # the last trainer, which is fine, is still used


def test_unset_variable_without_default(tmp_path):
    launch = read(
        tmp_path,
        f"""
        set -eu
        DIR=$CKPT_ROOT/run1
        echo $NOT_USED_BY_TRAINER
        {TRAINER} trainer.default_local_dir=$DIR \\
            trainer.nnodes=$NNODES ok=${{FINE:-1}}
        """,
    )
    errors = [(f.severity, f.line) for f in launch.findings if f.code == "unset-variable"]
    assert errors == [("error", 2), ("error", 5)]
    assert "CKPT_ROOT" in launch.findings[0].message and "${CKPT_ROOT:-default}" in launch.findings[0].message
    assert "NOT_USED_BY_TRAINER" not in str(launch.findings)

    without_u = read(tmp_path, f"{TRAINER} n=$NNODES\n")
    assert [(f.code, f.severity) for f in without_u.findings] == [("unset-variable", "warning")]
    assert without_u.overrides == ("n=",)


def test_required_variable(tmp_path):
    launch = read(
        tmp_path,
        f"""
        MODEL_PATH="${{MODEL_PATH:?set MODEL_PATH to the checkpoint}}"
        {TRAINER} actor_rollout_ref.model.path=$MODEL_PATH
        """,
    )
    finding = only(launch, "required-variable")
    assert (finding.severity, finding.line) == ("error", 1)
    assert "set MODEL_PATH to the checkpoint" in finding.message
    fine = read(tmp_path, "M=${M:?no}\npython -m verl.trainer.main_ppo m=$M\n", env={"M": "/m"})
    assert fine.findings == () and fine.overrides == ("m=/m",)


def test_no_trainer(tmp_path):
    launch = read(tmp_path, "ray start --head\npython3 -m verl.trainer.main_generation a=1\necho python3\n")
    finding = only(launch, "no-trainer")
    assert finding.severity == "error"
    assert "verl.trainer.main_ppo" in finding.message
    assert launch.module is None and launch.overrides == () and launch.trainer_line is None


def test_trainer_in_uncalled_function_is_pointed_at(tmp_path):
    launch = read(tmp_path, "train() {\n  python3 -m verl.trainer.main_ppo a=1\n}\n")
    assert "line 2" in only(launch, "no-trainer").message


def test_function_called_at_top_level(tmp_path):
    launch = read(tmp_path, 'train() {\n  local LR=$1\n  python3 -m verl.trainer.main_ppo lr=$LR "$@"\n}\ntrain 1e-6\n')
    assert launch.overrides == ("lr=1e-6", "1e-6")
    assert launch.trainer_line == 3


def test_source_env_file(tmp_path):
    (tmp_path / "env.sh").write_text("export HCCL_CONNECT_TIMEOUT=7200\nPP=4\nexport PP\nLOCAL_ONLY=1\n")
    launch = read(
        tmp_path,
        f"""
        source env.sh
        . ./missing.sh
        {TRAINER} pp=$PP
        """,
    )
    assert launch.env == {"HCCL_CONNECT_TIMEOUT": "7200", "PP": "4"}
    assert launch.variables["LOCAL_ONLY"] == "1"
    assert launch.overrides == ("pp=4",)
    missing = only(launch, "unresolved")
    assert missing.severity == "warning" and "missing.sh" in missing.message


def test_source_relative_to_script_dir_and_recursion(tmp_path):
    (tmp_path / "a.sh").write_text('source "$(dirname "$0")/a.sh"\nexport A=1\n')
    launch = read(tmp_path, 'source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/a.sh"\n' + TRAINER + "\n")
    assert launch.env == {"A": "1"}
    assert launch.findings == ()


def test_allexport_and_source_next_to_the_script(tmp_path):
    (tmp_path / "cluster.env").write_text("NNODES=32\nHCCL_BUFFSIZE=400\n")
    launch = read(
        tmp_path,
        f"""
        set -euo pipefail
        HERE="${{BASH_SOURCE[0]%/*}}"
        set -a
        source "${{ENV_FILE:-$HERE/cluster.env}}"
        set +a
        LOCAL=1
        {TRAINER} trainer.nnodes=$NNODES
        """,
    )
    assert launch.env == {"NNODES": "32", "HCCL_BUFFSIZE": "400"}
    assert launch.overrides == ("trainer.nnodes=32",)
    assert launch.variables["HERE"] == str(tmp_path) and launch.findings == ()


def test_subshell_and_append(tmp_path):
    launch = read(
        tmp_path,
        f"""
        NAME=run
        NAME+=_7
        ( NAME=lost; export LEAK=1 )
        typeset T=8
        {TRAINER} name=$NAME "$*" t=$T
        """,
        args=["a=1", "b=2"],
    )
    assert launch.overrides == ("name=run_7", "a=1 b=2", "t=8")
    assert launch.env == {} and "LEAK" not in launch.variables


def test_exports(tmp_path):
    launch = read(
        tmp_path,
        f"""
        export A=1 B=2
        C=3
        export C
        declare -x D=4
        E=5
        readonly R=6
        F=6 G="$A$B" {TRAINER} r=$R
        """,
        env={"HOME": "/root"},
    )
    assert launch.env == {"HOME": "/root", "A": "1", "B": "2", "C": "3", "D": "4", "F": "6", "G": "12"}
    assert "F" not in launch.variables and launch.variables["E"] == "5"
    assert launch.overrides == ("r=6",)


def test_quoting_and_word_splitting(tmp_path):
    launch = read(
        tmp_path,
        f"""
        TWO="x=1 y=2"
        LIT=zzz
        {TRAINER} trainer.logger='["console","wandb"]' \\
            name="my run" a="$TWO"b'$LIT' $TWO "$TWO" c=\\"q\\" d="\\$HOME" e=$'tab\\tx' ${{EMPTY}} ""
        """,
    )
    assert launch.overrides == (
        'trainer.logger=["console","wandb"]',
        "name=my run",
        "a=x=1 y=2b$LIT",
        "x=1",
        "y=2",
        "x=1 y=2",
        'c="q"',
        "d=$HOME",
        "e=tab\tx",
        "",
    )


def test_parameter_operators(tmp_path):
    launch = read(
        tmp_path,
        f"""
        P=/data/train.parquet
        {TRAINER} a=${{P%.parquet}} b=${{P#/data/}} c=${{P##*/}} d=${{#P}} e=${{P:+set}} f=${{NOPE:+set}} \\
            g=${{NEW:=assigned}} h=$NEW i=${{P/train/val}} j=${{P:6:5}} k=${{P^^}}
        """,
    )
    assert launch.overrides == (
        "a=/data/train",
        "b=train.parquet",
        "c=train.parquet",
        "d=19",
        "e=set",
        "f=",
        "g=assigned",
        "h=assigned",
        "i=/data/val.parquet",
        "j=train",
        "k=/DATA/TRAIN.PARQUET",
    )


@pytest.mark.parametrize("form", ["--config-name=ppo_megatron_trainer", "--config-name ppo_megatron_trainer"])
def test_config_name(tmp_path, form):
    launch = read(tmp_path, f"{TRAINER} {form} a=1\n")
    assert launch.config_name == "ppo_megatron_trainer"
    assert launch.overrides == ("a=1",)
    assert read(tmp_path, f"{TRAINER} a=1\n").config_name is None


def test_command_substitution_reaching_trainer(tmp_path):
    launch = read(
        tmp_path,
        f"""
        ARCH=$(uname -m)
        STAMP=$(date +%s)
        echo "$STAMP"
        {TRAINER} trainer.experiment_name=run_$ARCH
        """,
    )
    assert launch.overrides == ("trainer.experiment_name=run_<$(uname -m)>",)
    finding = only(launch, "unresolved")
    assert (finding.severity, finding.line) == ("warning", 1)
    assert "$(uname -m)" in finding.message and "date" not in str(launch.findings)


def test_assignment_inside_if_is_not_guessed(tmp_path):
    launch = read(
        tmp_path,
        f"""
        TP=2
        if [[ "$BIG" == 1 ]]; then TP=8; OTHER=1; fi
        for i in 1 2; do echo $i; done
        {TRAINER} tp=$TP
        """,
    )
    assert launch.overrides == ("tp=2",)
    finding = only(launch, "unresolved")
    assert "TP" in finding.message and finding.line == 2 and "OTHER" not in finding.message


def test_trainer_inside_if_is_found_with_a_warning(tmp_path):
    launch = read(tmp_path, f"if true; then\n  {TRAINER} a=1\nfi\n")
    assert launch.overrides == ("a=1",)
    assert only(launch, "unresolved").line == 2


@pytest.mark.parametrize(
    ("setup", "command"),
    [
        ("", "python"),
        ("", "python3.12"),
        ("", "/usr/bin/python3"),
        ("", "uv run python"),
        ('PYTHON="${PYTHON:-python3}"', '"$PYTHON"'),
        ("PY=$(which python3)", "$PY"),
        ("", '"$PYTHON"'),
    ],
)
def test_interpreter_forms(tmp_path, setup, command):
    launch = read(tmp_path, f"{setup or 'true'}\n{command} -u -m verl.trainer.main_ppo a=1\n")
    assert launch.module == "verl.trainer.main_ppo"
    assert launch.overrides == ("a=1",)
    assert launch.trainer_line == 2


def test_non_python_command_is_not_a_trainer(tmp_path):
    assert codes(read(tmp_path, "PY=ls\n$PY -m verl.trainer.main_ppo a=1\n")) == ["no-trainer"]


def test_multiple_trainers_uses_last(tmp_path):
    launch = read(tmp_path, f"{TRAINER} a=1\n{TRAINER} b=2\n")
    assert launch.overrides == ("b=2",) and launch.trainer_line == 2
    assert only(launch, "multiple-trainers").severity == "warning"


def test_unparsed(tmp_path):
    launch = read(tmp_path, f"{TRAINER} a=1\nX=$(( 1 + ))\n")
    finding = only(launch, "unparsed")
    assert (finding.severity, finding.line) == ("error", 2)


def test_statements_glued_by_the_grammar_are_split(tmp_path):
    # tree-sitter-bash parses these three lines as one command named `export`
    launch = read(tmp_path, f"A=1 B=2\n# comment\nC=$((A + B))\nexport D=$C\n{TRAINER} c=$C\n")
    assert launch.overrides == ("c=3",) and launch.env == {"D": "3"}


def test_missing_script_raises(tmp_path):
    with pytest.raises(LaunchError, match=r"nope\.sh"):
        read_launch_script(tmp_path / "nope.sh")
    assert issubclass(LaunchError, ValueError)


def test_launch_from_overrides():
    launch = launch_from_overrides(["--config-name", "ppo_megatron_trainer", "a=1", "+b=2"])
    assert launch == Launch(
        source="<overrides>",
        module="verl.trainer.main_ppo",
        config_name="ppo_megatron_trainer",
        overrides=("a=1", "+b=2"),
        passthrough=(),
        env={},
        variables={},
        findings=(),
        trainer_line=None,
    )
    assert launch_from_overrides(["--config-name=x", "c=3"]).config_name == "x"


def test_fast_on_a_long_script(tmp_path):
    lines = [f"V{i}=${{V{i}:-{i}}}" for i in range(100)]
    lines += [TRAINER + " \\"] + [f"    k{i}=$V{i} \\" for i in range(50)] + ['    "$@"']
    script = tmp_path / "long.sh"
    script.write_text("\n".join(lines) + "\n")
    read_launch_script(script)
    start = time.perf_counter()
    launch = read_launch_script(script, ["z=1"])
    assert time.perf_counter() - start < 0.1
    assert len(launch.overrides) == 51 and launch.overrides[-1] == "z=1"


def _glm5_script() -> Path | None:
    found = sorted(p for p in REPO_ROOT.glob("examples/*/*.sh") if "run_glm5" in p.name)
    return found[0] if found else None


@pytest.mark.skipif(_glm5_script() is None, reason="no examples/*/run_glm5*.sh launch script in this checkout")
def test_real_glm5_script():
    env = {"MODEL_PATH": "/models/GLM-5.2", "TRAIN_FILES": "/data/train.parquet", "VAL_FILES": "/data/val.parquet"}
    launch = read_launch_script(_glm5_script(), ["trainer.total_training_steps=200"], env)
    assert launch.config_name == "ppo_megatron_trainer"
    for override in (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=9",
        "data.max_prompt_length=24576",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
        "actor_rollout_ref.model.path=/models/GLM-5.2",
        'trainer.logger=["console"]',
    ):
        assert override in launch.overrides
    assert launch.overrides[-1] == "trainer.total_training_steps=200"
    assert launch.env["HCCL_CONNECT_TIMEOUT"] == "7200"
    assert launch.env["VERL_USE_EXTERNAL_MODULES"] == "verl_npu.megatron_adaptor"
    assert not [f for f in launch.findings if f.severity == "error"]


BASH_CASES = [
    'A="x  y"; B=(1 "2 3" \'\')\n$T $A "$A" "${B[@]}" ${B[@]} "${B[*]}" a="$A"b "$@"',
    'P=/a/b.c.d\n$T ${P%.*} ${P%%.*} ${P#*/} ${P##*/} ${#P} ${Q:-"q r"} ${Q:-q r}',
    'N=5; M=N\n$T $((N * (2 + 3) % 7)) $((M + 1)) $((-9 / 2)) $((-9 % 4)) "$#" "$1"',
    'E=\n$T "" $E "$E" ${E:-d} ${E-d} "${E:+x}" x\\ y \'$E\' $\'a\\tb\' "$*" $*',
    'Z=(); Z+=(a "b c"); S=abcdef\n$T "${Z[@]}" "${@:2}" ${S:1:3} ${S/cd/X} "${Y:-${W:-z}}"',
    'f() {\n  shift\n  $T "a=\\$1\\"q\\"" "$@" "${E[@]}" ${#Z[@]} "$((${#1} + 1))"\n}\nf x y "z w"',
    'X=~/v; A=([1]=a [5]="b c")\n$T ~/x a=~/y ~ "~/q" x~/z data.x=~/d $X "${A[@]}" $\'\\x41\\101\'',
]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("body", BASH_CASES)
def test_matches_real_bash(tmp_path, body):
    """For scripts without side effects, the static reading equals what bash passes to the interpreter."""
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\nshift 2\nprintf "%s\\0" "$@" > "$OUT"\n')
    stub.chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text('T="python3 -m verl.trainer.main_ppo"\n' + body + "\n")
    args = ["k=1", "l=two words", ""]
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": "/home/u"}
    subprocess.run(["bash", str(script), *args], env=env, check=True)
    expected = (tmp_path / "out").read_text().split("\0")[:-1]
    launch = read_launch_script(script, args, env)
    assert list(launch.overrides) == expected
    assert [f for f in launch.findings if f.severity == "error"] == []
