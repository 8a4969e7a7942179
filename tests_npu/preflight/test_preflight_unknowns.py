"""Preflight on launches with values only the running script knows, and with Hydra's --config-path / --config-dir
(issue 18: no false NO-GO for a run name from `date`, no GO for a size preflight could not range-check, and the
config directory the trainer composes from is the one preflight composes from)."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tree_sitter_bash", reason="the launch reader parses bash with tree-sitter; not installed here")

from support.paths import REPO

from verl_npu.checks import FAIL
from verl_npu.preflight import run_preflight
from verl_npu.preflight.compose import ConfigSearchError, config_search, verl_config_dir

EXAMPLE = REPO / "examples" / "glm5_2"
SCRIPT = "run_glm5_2_grpo_a3.sh"
TRAINER_LINE = '"$PYTHON" -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \\\n'


def variant(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    target = tmp_path / "glm5_2"
    shutil.copytree(EXAMPLE, target)
    script = target / SCRIPT
    text = script.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    script.write_text(text)
    return script


def fails(report) -> list[str]:
    return [c.detail for c in report.checks if c.status == FAIL]


def test_a_run_name_from_date_and_a_loop_is_go_with_warnings(tmp_path):
    script = variant(
        tmp_path,
        (
            "MEGATRON=actor_rollout_ref.actor.megatron\n",
            "MEGATRON=actor_rollout_ref.actor.megatron\nfor t in x y; do TAG=$t; done\n",
        ),
        ("trainer.experiment_name=glm5_grpo_a3_32n", "trainer.experiment_name=run_$(date +%Y%m%d)_$TAG"),
    )
    report = run_preflight(script)
    assert report.verdict == "go", fails(report)
    assert "trainer.experiment_name=run_<$(date +%Y%m%d)>_<$TAG>" in report.overrides
    warned = " ".join(c.detail for c in report.checks if c.check == "launch.unresolved")
    assert "$(date +%Y%m%d)" in warned and "TAG is assigned inside a for loop" in warned
    assert not any("VERL_NPU_UNKNOWN" in c.detail for c in report.checks)


def test_a_size_only_the_running_script_knows_is_no_go_naming_it(tmp_path):
    script = variant(tmp_path, ("data.train_batch_size=64", "data.train_batch_size=$(cat batch)"))
    report = run_preflight(script)
    assert report.verdict == "no-go"
    (detail,) = fails(report)
    assert detail.startswith("data.train_batch_size='<$(cat batch)>': expected a value known before the launch runs")
    assert any(c.check == "config.not-computed" for c in report.checks)


def _custom_trainer(directory: Path, verl_dir: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "my_trainer.yaml").write_text(
        textwrap.dedent(
            f"""\
            hydra:
              searchpath:
                - file://{verl_dir}
            defaults:
              - ppo_megatron_trainer
              - _self_
            actor_rollout_ref:
              rollout:
                pipeline_model_parallel_size: -5
            """
        )
    )


def test_the_config_path_of_the_launch_is_the_one_composed(tmp_path):
    _custom_trainer(tmp_path / "conf", verl_config_dir())
    script = variant(
        tmp_path,
        (
            TRAINER_LINE,
            f'"$PYTHON" -m verl.trainer.main_ppo --config-path={tmp_path / "conf"} --config-name=my_trainer \\\n',
        ),
    )
    report = run_preflight(script)
    assert report.verdict == "no-go"
    assert "actor_rollout_ref.rollout.pipeline_model_parallel_size=-5: expected an integer from 1 to 65536" in fails(
        report
    )
    compose = next(c for c in report.checks if c.check == "config.compose")
    assert f"my_trainer.yaml from {tmp_path / 'conf'}" in compose.detail


def test_a_config_dir_adds_a_search_directory(tmp_path):
    group = tmp_path / "extra" / "trainer_extras"
    group.mkdir(parents=True)
    (group / "small.yaml").write_text("# @package _global_\ndata:\n  train_batch_size: 0\n")
    script = variant(
        tmp_path,
        (
            TRAINER_LINE,
            f'"$PYTHON" -m verl.trainer.main_ppo --config-dir {tmp_path / "extra"} '
            "--config-name=ppo_megatron_trainer \\\n",
        ),
        ("data.train_batch_size=64 \\\n", "+trainer_extras=small \\\n"),
    )
    report = run_preflight(script)
    assert "data.train_batch_size=0: expected an integer from 1 to 16777216" in fails(report)


def test_config_paths_resolve_as_hydra_resolves_them(tmp_path, monkeypatch):
    verl = verl_config_dir()
    assert config_search().primary == verl
    assert config_search("config").primary == verl  # relative to verl/trainer (main_ppo.py), not to the cwd
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    assert config_search(None, "mine").extra == tmp_path / "mine"  # --config-dir: relative to the cwd
    for args, message in [
        (("/no/such/dir",), "--config-path=/no/such/dir: /no/such/dir is not a directory"),
        (("mine",), f"--config-path=mine: {verl.parent / 'mine'} is not a directory (relative paths start at"),
        (("pkg://verl.trainer.config",), "preflight composes from a directory"),
        ((None, "<$(pwd)>/x", ["<$(pwd)>"]), "--config-dir=<$(pwd)>/x: only known when the launch runs"),
    ]:
        with pytest.raises(ConfigSearchError, match=None) as exc:
            config_search(*args)
        assert message in str(exc.value)


def test_an_unusable_config_path_is_one_fail_and_no_worker(tmp_path, monkeypatch):
    from verl_npu.preflight import pipeline

    monkeypatch.setattr(pipeline, "start_worker", lambda *a: pytest.fail("a worker started for an unusable config"))
    script = variant(tmp_path, (TRAINER_LINE, '"$PYTHON" -m verl.trainer.main_ppo --config-path=/nowhere \\\n'))
    report = run_preflight(script)
    assert [(c.check, c.detail) for c in report.checks if c.status == FAIL] == [
        ("config.config-path", "--config-path=/nowhere: /nowhere is not a directory")
    ]


def test_a_config_dir_whose_name_holds_hydras_list_syntax_is_one_search_directory(tmp_path):
    from verl_npu.preflight.compose import compose_config

    extra = tmp_path / "odd,name]'x"
    (extra / "trainer_extras").mkdir(parents=True)
    (extra / "trainer_extras" / "small.yaml").write_text("# @package _global_\ndata:\n  train_batch_size: 7\n")
    config, checks = compose_config(None, ["+trainer_extras=small"], config_search(None, str(extra)))
    assert config is not None and config.data.train_batch_size == 7, checks


def test_a_home_of_no_such_user_is_a_named_error_everywhere(tmp_path, capsys):
    from verl_npu.cli import main
    from verl_npu.preflight.model_shape import ModelConfigError, load_config

    with pytest.raises(ConfigSearchError, match="~nosuchuser-verl-npu/x"):
        config_search(None, "~nosuchuser-verl-npu/x")
    with pytest.raises(ModelConfigError, match="~nosuchuser-verl-npu/m"):
        load_config("~nosuchuser-verl-npu/m")
    script = EXAMPLE / SCRIPT
    assert main(["preflight", str(script), "--json", "~nosuchuser-verl-npu/r.json"]) == 2
    assert "--json='~nosuchuser-verl-npu/r.json'" in capsys.readouterr().err
