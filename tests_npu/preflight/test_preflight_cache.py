"""Preflight's answer cache against hostile entries (issue 18): foreign, stale, well-sealed but malformed,
unwritable; atomic writes; and the worker's timeout, which ends its whole process group."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO
from support.processes import gone_soon, grandchild, hanging_script

from verl_npu import atomic
from verl_npu.checks import FAIL
from verl_npu.preflight import run_preflight, worker

LAUNCH = REPO / "examples" / "glm5_2" / "run_glm5_2_grpo_a3.sh"
ANSWER = {
    "hf": {"model_type": "glm_moe_dsa"},
    "model_check": {"check": "config.model", "status": "ok", "detail": "d", "fix": ""},
    "checks": [{"check": "config.verl-validation", "status": "ok", "detail": "d", "fix": ""}],
    "model_origin": "model-config",
    "model_files": {},
}


def reseal(path: Path, edit) -> None:
    """Edit a cache entry and seal it again: the sha256 is right, only what it says is wrong."""
    entry = json.loads(path.read_text())
    entry.pop("sha256")
    edit(entry)
    body = json.dumps(entry, sort_keys=True)
    path.write_text(json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), **entry}, sort_keys=True))


# --- the entry itself (no worker) ----------------------------------------------------------------


def test_an_entry_records_its_key_and_the_versions_that_wrote_it():
    entry = json.loads(worker._seal(ANSWER, "k" * 64))
    assert entry["key"] == "k" * 64 and entry["format"] == worker.CACHE_FORMAT
    assert set(entry["versions"]) == {"verl-npu", "verl", "python"}
    assert worker._unseal(worker._seal(ANSWER, "k" * 64), "k" * 64) == ANSWER


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda e: e.update(key="other"), "it answers another launch"),
        (lambda e: e["versions"].update(verl="0.0.1"), "written by"),
        (lambda e: e["versions"].update(python="2.7.18"), "written by"),
        (lambda e: e.update(format=1), "cache format 1"),
        (lambda e: e.update(answer=[1, 2]), "not a mapping"),
        (lambda e: e["answer"].update(checks={"a": 1}), "checks is not a list"),
        (lambda e: e["answer"].update(checks=[["config", "ok"]]), "checks[0] is not a check"),
        (lambda e: e["answer"].update(model_check={"check": "x", "status": "great", "detail": "d"}), "unknown status"),
        (lambda e: e["answer"].update(model_check={"check": "x", "status": "ok", "detail": "d", "x": 1}), "keys"),
        (lambda e: e["answer"].update(hf=[]), "hf is neither null nor a mapping"),
        (lambda e: e["answer"].update(model_files=["a"]), "model_files"),
        (lambda e: e["answer"].update(composed={"config": 3, "checks": []}), "composed has no config text"),
        (lambda e: e["answer"].pop("checks"), "missing ['checks']"),
    ],
)
def test_a_well_sealed_entry_that_is_foreign_stale_or_malformed_is_refused_with_the_reason(tmp_path, edit, why):
    path = tmp_path / "entry.json"
    path.write_text(worker._seal(ANSWER, "k" * 64))
    reseal(path, edit)
    answer, reason = worker._read_entry(path.read_text(), "k" * 64)
    assert answer is None and why in reason, reason


@pytest.mark.parametrize("text", ["", "[", "[]", '{"sha256": 1}', "[" * 100000, '{"sha256": "00", "answer": {}}'])
def test_garbage_is_refused_without_an_exception(text):
    answer, reason = worker._read_entry(text, "k")
    assert answer is None and reason


# --- the cache on a real launch --------------------------------------------------------------------


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """One real preflight of the GLM-5.2 example with its cache entry (the cold run, once for the module)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VERL_NPU_CACHE_DIR", str(cache))
        report = run_preflight(LAUNCH)
    (entry,) = cache.rglob("*.json")
    return report.to_dict(), entry.read_text()


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda e: e["answer"].update(checks={"not": "a list"}), id="dict-for-list"),
        pytest.param(lambda e: e["answer"].update(model_check=["config.model", "ok"]), id="list-for-dict"),
        pytest.param(lambda e: e.update(key="0" * 64), id="foreign-key"),
        pytest.param(lambda e: e["versions"].update({"verl-npu": "0.0.0"}), id="other-verl-npu"),
        pytest.param(lambda e: e["answer"]["composed"].update(config="- a\n- b\n"), id="composed-not-a-mapping"),
    ],
)
def test_a_corrupt_or_foreign_entry_is_ignored_with_a_warning_naming_it_and_rewritten(
    tmp_path, monkeypatch, capsys, first, edit
):
    expected, text = first
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    key = json.loads(text)["key"]
    path = worker.cache_dir() / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    reseal(path, edit)
    capsys.readouterr()
    assert run_preflight(LAUNCH).to_dict() == expected
    err = capsys.readouterr().err
    assert f"ignoring the cache entry {path}" in err and "--no-cache" in err, err
    assert worker._unseal(path.read_text(), key) is not None  # recomputed and sealed again, for this key
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def recorded_children(monkeypatch) -> list[subprocess.Popen[bytes]]:
    """Every worker process started from now on (the real ones)."""
    started: list[subprocess.Popen[bytes]] = []
    real_start_child = worker.start_child
    monkeypatch.setattr(worker, "start_child", lambda: started.append(real_start_child()) or started[-1])
    return started


def test_an_intact_entry_is_used_without_a_warning(tmp_path, monkeypatch, capsys, first):
    expected, text = first
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    path = worker.cache_dir() / f"{json.loads(text)['key']}.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    started = recorded_children(monkeypatch)  # the worker starts before the launch is read: a cold check waits less
    monkeypatch.setattr(worker.processes, "communicate", lambda *a, **k: pytest.fail("the worker ran on a hit"))
    capsys.readouterr()
    assert run_preflight(LAUNCH).to_dict() == expected
    assert "warning" not in capsys.readouterr().err
    (child,) = started
    assert child.poll() is not None and child.returncode < 0  # ended by a signal at the hit, never asked


def test_the_cli_starts_the_worker_first_and_hands_it_to_the_check(tmp_path, monkeypatch, first):
    """`verl-npu preflight` starts the worker before it imports the pipeline, and the check uses that one."""
    from verl_npu.cli import main

    expected, text = first
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    path = worker.cache_dir() / f"{json.loads(text)['key']}.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    started = recorded_children(monkeypatch)
    out = tmp_path / "report.json"
    assert main(["preflight", str(LAUNCH), "--json", str(out)]) == (0 if expected["verdict"] == "go" else 1)
    assert json.loads(out.read_text())["verdict"] == expected["verdict"]
    (child,) = started  # one worker: the CLI's, not a second one started by run_preflight
    assert child.poll() is not None and child.returncode < 0  # ended at the hit


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--env", "NOT-A-PAIR"], id="bad-env"),
        pytest.param(["--host-memory-gib", "0"], id="bad-host-memory"),
        pytest.param([], id="no-launch"),
    ],
)
def test_a_bad_option_ends_the_worker_the_cli_started(monkeypatch, argv):
    from verl_npu.cli import main

    started = recorded_children(monkeypatch)
    launch = [str(LAUNCH)] if argv else []
    assert main(["preflight", *launch, *argv]) == 2
    (child,) = started
    assert child.poll() is not None and child.returncode < 0  # ended by a signal, not left importing verl


def test_an_unusable_cache_directory_means_no_cache_and_a_warning(tmp_path, monkeypatch, capsys, first):
    expected, _ = first
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(blocker))
    capsys.readouterr()
    assert run_preflight(LAUNCH).to_dict() == expected
    err = capsys.readouterr().err
    assert "cannot create the cache directory" in err and str(blocker) in err and "--no-cache" in err, err


def test_a_failing_cache_write_is_a_warning_and_the_old_entry_stays(tmp_path, monkeypatch, capsys):
    """ENOSPC half-way through the write: the entry on disk is the old one, whole; the check goes on."""
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    path = worker.cache_dir() / "k.json"
    path.parent.mkdir(parents=True)
    old = worker._seal(ANSWER, "k")
    path.write_text(old)
    probe = object.__new__(worker.PreflightWorker)
    probe._cache, probe._key = path, "k"
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    probe._store({**ANSWER, "model_origin": "name"})
    monkeypatch.undo()
    assert path.read_text() == old
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]
    err = capsys.readouterr().err
    assert f"cannot write the cache entry {path} (No space left on device)" in err and "--no-cache" in err


def test_concurrent_writers_never_share_a_temporary_file(tmp_path):
    """Eight processes (ranks) write the same entry at once: each through its own temporary file."""
    target = tmp_path / "entry.json"
    code = (
        "import sys; from verl_npu import atomic\n"
        "for i in range(200): atomic.write_text(sys.argv[1], sys.argv[2] * 5000)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target), str(n)]) for n in range(8)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 8
    text = target.read_text()
    assert len(text) == 5000 and len(set(text)) == 1  # one writer's content, whole
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]


def test_atomic_write_keeps_the_files_mode(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text("{}")
    path.chmod(0o640)
    atomic.write_text(path, "{}\n")
    assert path.stat().st_mode & 0o777 == 0o640


def test_the_workers_timeout_ends_its_process_group(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    script = hanging_script(tmp_path / "worker", tmp_path / "pid")
    monkeypatch.setattr(worker, "WORKER_COMMAND", (str(script),))
    job = worker.PreflightWorker(None, [], None, use_cache=False)
    pid = grandchild(tmp_path / "pid")
    hf, model, checks, _ = job.ask(OmegaConf.create({"a": 1}), None, None, timeout=1.0)
    assert hf is None and model.status == FAIL
    assert checks[0].status == FAIL and "did not answer within 1 s" in checks[0].detail
    assert gone_soon(pid), "the worker's grandchild outlived the timeout"


def test_cancel_ends_the_workers_process_group(tmp_path, monkeypatch):
    script = hanging_script(tmp_path / "worker", tmp_path / "pid", ignore_term=True)
    monkeypatch.setattr(worker, "WORKER_COMMAND", (str(script),))
    job = worker.PreflightWorker(None, [], None, use_cache=False)
    pid = grandchild(tmp_path / "pid")
    job.cancel()
    assert gone_soon(pid) and not job.running


def test_a_cache_key_reads_no_fifo_and_gives_up_on_too_many_configs(tmp_path, monkeypatch):
    import os
    import threading

    from verl_npu.preflight import worker

    configs = tmp_path / "conf"
    configs.mkdir()
    os.mkfifo(configs / "blocks.yaml")  # reading it would never end
    (configs / "a.yaml").write_text("x: 1\n")
    keys = []
    thread = threading.Thread(target=lambda: keys.append(worker.cache_key(None, [], None, None, [configs])))
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and isinstance(keys[0], str)
    monkeypatch.setattr(worker, "MAX_CONFIG_FILES", 1)
    assert worker.cache_key(None, [], None, None, [configs]) is None  # then preflight runs without a cache
