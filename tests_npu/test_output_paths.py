"""Every file verl-npu writes goes through verl_npu.atomic (issue 29, class 1).

What is at an output path is never destroyed: a directory, device, FIFO or socket there (or at the end of the
path's symlinks) is refused, exit 2 naming the path and what it is, and left as it was; a symlink to a regular
file is written through (the link stays a link, a link into another directory writes there).

OUTPUTS is the list of every output path of the CLI; test_outputs_names_every_output_option_of_the_cli keeps it
complete against the argument parsers. The commands run in this process with the cheapest valid inputs; where the
work itself is expensive (a preflight, a parity job, a Ray cluster), a test double stands in for that work only, and
the refusal is shown to come before it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu import atomic

OLD = b"old content\n"


# --- the writer ---------------------------------------------------------------------------------------------------
def make_device(path: Path) -> bool:
    """A character device (/dev/null's numbers) at ``path``; False where this process may not make one."""
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        return False
    return True


def identity(path: Path) -> tuple[int, int, int]:
    """What is at ``path`` itself (not followed): its kind and inode, which a replacement would change."""
    found = os.lstat(path)
    return found.st_mode, found.st_ino, found.st_rdev


def no_temporary_files(*directories: Path) -> bool:
    return not [p for d in directories for p in d.iterdir() if p.name.endswith(".tmp")]


def refused(path: Path, *words: str, kind: bool = True) -> str:
    """The message of the refusal to write ``path``, which must name it and each of ``words`` (and, for ``kind``,
    say what to give instead)."""
    with pytest.raises(atomic.OutputPathError) as caught:
        atomic.write_bytes(path, b"new\n")
    message = str(caught.value)
    assert str(path) in message and all(w in message for w in words), message
    assert not kind or "give the path of a regular file or of a new one" in message, message
    return message


def test_a_character_device_is_refused_and_left_alone(tmp_path):
    device = tmp_path / "full"
    if not make_device(device):
        pytest.skip("os.mknod needs CAP_MKNOD (root); the FIFO and socket tests cover the same refusal")
    before = identity(device)
    refused(device, "is a character device")
    assert identity(device) == before and atomic.output_problem(device).startswith("it is a character device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    before = identity(fifo)
    outcome = []

    def write():  # opening a FIFO for writing blocks until a reader comes: a thread keeps the test from hanging
        try:
            atomic.write_bytes(fifo, b"new\n")
        except atomic.OutputPathError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the writer blocked on the FIFO"
    assert outcome and str(fifo) in outcome[0] and "is a FIFO" in outcome[0]
    assert identity(fifo) == before and no_temporary_files(tmp_path)


def test_a_socket_is_refused(tmp_path):
    path = tmp_path / "s"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        before = identity(path)
        refused(path, "is a socket")
        assert identity(path) == before
    finally:
        server.close()


def test_a_directory_is_refused_and_what_it_holds_is_kept(tmp_path):
    directory = tmp_path / "report.json"
    directory.mkdir()
    (directory / "inside").write_bytes(OLD)
    refused(directory, "is a directory")
    assert (directory / "inside").read_bytes() == OLD and no_temporary_files(tmp_path)


def linked(tmp_path: Path, name: str = "out.json") -> tuple[Path, Path, Path]:
    """(a link in links/ to elsewhere/NAME holding OLD, that file, a bystander file beside it)."""
    links, elsewhere = tmp_path / "links", tmp_path / "elsewhere"
    links.mkdir(exist_ok=True)
    elsewhere.mkdir(exist_ok=True)
    target, bystander = elsewhere / name, elsewhere / "bystander"
    target.write_bytes(OLD)
    bystander.write_bytes(OLD)
    link = links / name
    link.symlink_to(target)
    return link, target, bystander


def test_a_symlink_to_a_regular_file_is_written_through_and_stays_a_link(tmp_path):
    link, target, bystander = linked(tmp_path)
    target.chmod(0o640)
    atomic.write_bytes(link, b"new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"new\n" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert bystander.read_bytes() == OLD
    assert [p.name for p in link.parent.iterdir()] == [link.name] and no_temporary_files(target.parent)


def test_a_symlink_chain_is_written_through_to_its_last_file(tmp_path):
    link, target, _ = linked(tmp_path)
    first = tmp_path / "first"
    first.symlink_to(os.path.relpath(link, tmp_path))  # relative, as `ln -s` often makes them
    atomic.write_text(first, "new\n")
    assert first.is_symlink() and link.is_symlink() and target.read_text() == "new\n"


def test_a_symlink_to_a_directory_is_refused_naming_the_directory(tmp_path):
    directory = tmp_path / "results"
    directory.mkdir()
    link = tmp_path / "out.json"
    link.symlink_to(directory)
    refused(link, f"a symlink to {directory}, which is a directory")
    assert link.is_symlink() and list(directory.iterdir()) == []


def test_a_symlink_to_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "out.json"
    link.symlink_to(fifo)
    refused(link, f"a symlink to {fifo}, which is a FIFO")
    assert link.is_symlink() and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_dangling_symlink_creates_its_target_as_open_would(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "new.json"
    link = tmp_path / "out.json"
    link.symlink_to(target)
    atomic.write_text(link, "{}\n")
    assert link.is_symlink() and target.read_text() == "{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~atomic._umask()  # an ordinary new file, not mkstemp's 0600


def test_a_dangling_symlink_into_a_missing_directory_is_refused_naming_it(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "gone" / "new.json")
    refused(link, f"directory {tmp_path / 'gone'} does not exist", kind=False)
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_a_symlink_loop_is_refused(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    refused(tmp_path / "a", "does not resolve", kind=False)


def test_a_link_to_a_file_a_process_holds_open_is_refused(tmp_path):
    """/dev/stdout redirected to a file: a rename would swap the file under the shell, not add to it."""
    held = tmp_path / "held.log"
    held.write_bytes(OLD)
    with held.open("ab") as handle:
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{handle.fileno()}")
        for path in (Path(f"/proc/self/fd/{handle.fileno()}"), link):
            refused(path, "a file a process holds open", kind=False)
    assert held.read_bytes() == OLD


def test_an_unwritable_directory_is_refused_before_any_work(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores a directory's permission bits; the /proc test covers an unwritable directory")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert f"directory {locked} is not writable" in atomic.output_problem(locked / "r.json")
        with pytest.raises(OSError, match=f"cannot create a file in directory {locked}"):
            atomic.write_bytes(locked / "r.json", b"x")
    finally:
        locked.chmod(0o755)


def test_a_directory_no_one_can_create_a_file_in_is_refused_even_as_root():
    """/proc takes no new file whatever the permission bits say: the check creates one, it does not guess."""
    path = Path("/proc/verl-npu-output.json")
    assert atomic.output_problem(path).startswith("directory /proc is not writable")
    with pytest.raises(OSError, match="cannot create a file in directory /proc") as caught:
        atomic.write_bytes(path, b"x")
    assert caught.value.filename == str(path)  # named after the user's path, not a temporary one


def test_a_regular_file_used_as_a_directory_is_named(tmp_path):
    (tmp_path / "file").write_bytes(OLD)
    assert atomic.output_problem(tmp_path / "file" / "r.json") == f"{tmp_path / 'file'} is not a directory"
    assert atomic.output_problem(tmp_path / "nodir" / "r.json") == f"directory {tmp_path / 'nodir'} does not exist"


def test_a_path_that_becomes_a_fifo_while_it_is_written_is_not_replaced(tmp_path):
    path = tmp_path / "out.json"

    def fill_and_race(temporary: Path) -> None:
        temporary.write_bytes(b"new\n")
        os.mkfifo(path)  # another process, between the check and the rename

    with pytest.raises(atomic.OutputPathError, match="became a FIFO"):
        atomic.write_with(path, fill_and_race)
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and no_temporary_files(tmp_path)


def test_write_with_takes_a_library_that_replaces_the_temporary_file(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(OLD)
    path.chmod(0o604)

    def replace_it(temporary: Path) -> None:  # writers that save to NAME.part and rename it onto NAME
        part = temporary.with_name(temporary.name + ".part")
        part.write_bytes(b"new\n")
        os.replace(part, temporary)

    atomic.write_with(path, replace_it)
    assert path.read_bytes() == b"new\n" and stat.S_IMODE(path.stat().st_mode) == 0o604
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_a_name_of_the_longest_length_a_file_system_allows_is_written(tmp_path):
    """The temporary file is named after the output: it must fit in NAME_MAX even when the output's name does."""
    path = tmp_path / ("é" * 127 + "x")  # 255 bytes in UTF-8
    atomic.write_text(path, "new\n")
    assert path.read_text() == "new\n" and atomic.output_problem(path) is None and no_temporary_files(tmp_path)


def test_a_regular_file_and_a_new_path_are_written_whole(tmp_path):
    existing = tmp_path / "a.json"
    existing.write_bytes(OLD)
    atomic.write_text(existing, "new\n")
    atomic.write_text(tmp_path / "b.json", "fresh\n")
    assert existing.read_text() == "new\n" and (tmp_path / "b.json").read_text() == "fresh\n"
    assert atomic.output_problem(existing) is None and atomic.output_problem(tmp_path / "c.json") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]  # the check's probe file is gone


# --- every output path of the CLI ---------------------------------------------------------------------------------
def call(entry: Callable[[list[str]], int], *argv: str) -> tuple[int, str]:
    """Run a command's entry point in this process: (exit code, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = entry(list(argv))
        except SystemExit as exc:  # argparse's parser.error
            code = exc.code
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
    return code, err.getvalue()


def verl_npu(*argv: str) -> tuple[int, str]:
    from verl_npu.cli import main

    return call(main, *argv)


def no_work(what: str) -> Callable[..., None]:
    def fail(*args, **kwargs):
        pytest.fail(f"{what} ran before the output path was refused")

    return fail


class Stock:
    """Valid inputs of each command, made once for the module and only when a test asks for them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @functools.cached_property
    def ci_log(self) -> Path:
        lines = [f"(TaskRunner pid=1) step:{s} - perf/throughput:1000.0 - timing_s/step:60.0" for s in range(1, 16)]
        path = self.root / "t.log"
        path.write_text("\n".join(lines) + "\n")
        return path

    def baseline(self, where: Path) -> Path:
        limits = {"perf/throughput": {"kind": "relative", "max_decrease": 0.05},
                  "timing_s/step": {"kind": "relative", "max_increase": 0.05}}  # fmt: skip
        data = {"job": "job", "window": {"first_step": 5, "last_step": 14},
                "metrics": {m: {"value": v, "limit": limits[m]} for m, v in
                            {"perf/throughput": 1000.0, "timing_s/step": 60.0}.items()}}  # fmt: skip
        where.write_text(json.dumps(data))
        return where

    @functools.cached_property
    def env_file(self) -> Path:
        path = self.root / "cluster.env"
        path.write_text("MODEL_PATH=/root/.cache/models/m\nNNODES=4\nNPUS_PER_NODE=16\n")
        return path

    @functools.cached_property
    def image(self) -> str:
        from verl_npu.ci.images import image_tag

        return image_tag("a3", "0123456789abcdef0123456789abcdef01234567", registry="registry.example/team")

    @functools.cached_property
    def parity_runs(self) -> dict[str, Path]:
        """The reference's own H200 runs (format 2), cut to the dense model and to their end-to-end values (no
        block-boundary tensors: these runs are compared and derived end to end), as `parity run` files. The
        reference keeps no fp64 run, which `parity reference` takes: its fp32 run stands in, relabelled (what these
        tests judge is where each output is written, not its numbers)."""
        from verl_npu.parity import compare as cmp
        from verl_npu.parity.cli import DEFAULT_REFERENCE

        reference = cmp.load(DEFAULT_REFERENCE, cmp.REFERENCE_KIND)
        runs = {}
        for dtype, recorded in (("bf16", "bf16"), ("fp32", "fp32"), ("fp64", "fp32")):
            run = {k: v for k, v in cmp.reference_run(reference, recorded).items() if k != "_path"}
            dense = run["models"]["dense"]
            evaluation = {k: v for k, v in dense["eval"].items() if k != "replay"}
            run["models"] = {"dense": {**dense, "eval": evaluation}}
            run["dtype"] = dtype
            runs[dtype] = self.root / f"parity-{dtype}.json"
            runs[dtype].write_text(json.dumps(run))
        return runs

    @functools.cached_property
    def gsm8k_raw(self) -> Path:
        import pandas as pd

        root = self.root / "gsm8k"
        rows = {"train": [("Two and two?", "2 + 2 = 4\n#### 4")], "test": [("One and one?", "1 + 1 = 2\n#### 2")]}
        for split, values in rows.items():
            path = root / "main" / f"{split}-00000-of-00001.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(values, columns=["question", "answer"]).to_parquet(path, index=False)
        return root


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> Stock:
    return Stock(tmp_path_factory.mktemp("stock"))


@dataclasses.dataclass(frozen=True)
class Output:
    """How one output path of the CLI is written. ``run(path, stock, patch, guard)`` runs the command with its
    output at ``path``; with ``guard`` the command's work fails the test if it starts (a refusal comes first)."""

    filename: str  # the path's last part: fixed where the command names the file itself
    run: Callable[[Path, Stock, pytest.MonkeyPatch, bool], tuple[int, str]]
    written: Callable[[bytes], bool]  # what the file holds once written


def _preflight(option: str):
    def run(path, stock, patch, guard):
        import verl_npu.preflight as preflight
        from verl_npu.checks import OK, Check
        from verl_npu.parallelism import Parallelism
        from verl_npu.preflight.memory import GiB, estimate
        from verl_npu.preflight.model_shape import ModelShape
        from verl_npu.preflight.report import PreflightReport

        def judged(*args, **kwargs):  # a real report of a small dense model: the judging is preflight's own tests'
            shape = ModelShape.from_dict(dict(model_type="llama", vocab_size=1000, hidden_size=64,
                                              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                              num_key_value_heads=2))  # fmt: skip
            memory = estimate(shape, Parallelism(world=1), capacity_bytes=64 * GiB, overhead_bytes=0)
            return PreflightReport("<overrides>", "a3", [Check("x.y", OK, "fine")], [], memory=memory)

        patch.setattr(preflight, "run_preflight", no_work("preflight") if guard else judged)
        return verl_npu("preflight", option, str(path), "--overrides", "--", "--config-name=ppo_megatron_trainer")

    return run


def _preflight_cache_entry(path, stock, patch, guard):
    """The cache's check before a preflight uses it, and its store after; a problem is a warning, never exit 2."""
    from verl_npu.preflight import worker

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        usable = worker.PreflightWorker._usable_cache(path)
        if usable is not None:
            entry = object.__new__(worker.PreflightWorker)
            entry._cache, entry._key = usable, "k" * 64
            entry._store({"hf": None, "checks": [], "model_check": {}})
    return (0 if usable is not None else 2), err.getvalue()


def _doctor(path, stock, patch, guard):
    import verl_npu.doctor as doctor

    if guard:
        patch.setattr(doctor, "diagnose", no_work("doctor's probes"))
    return verl_npu("doctor", "--no-layer", "--report", str(path))


def _ci_compare_json(path, stock, patch, guard):
    import verl_npu.ci.compare as cmp

    if guard:
        patch.setattr(cmp, "read_log", no_work("reading the log"))
    baseline = stock.baseline(path.parent.parent / "baseline.json")
    return verl_npu("ci", "compare", str(stock.ci_log), str(baseline), "--json", str(path))


def _ci_compare_update(path, stock, patch, guard):
    import verl_npu.ci.compare as cmp

    if guard:
        patch.setattr(cmp, "read_log", no_work("reading the log"))
    if path.is_symlink():
        stock.baseline(path.resolve())
    return verl_npu("ci", "compare", str(stock.ci_log), str(path), "--update", "--image", "img", "--commit", "0123abcd")


def _contracts(path, stock, patch, guard):
    import verl_npu.contracts.verify as verify

    if guard:
        patch.setattr(verify, "verify", no_work("verifying the contracts"))
    return verl_npu("contracts", "verify", "--component", "torch-npu", "--json", str(path))


def _k8s(kind: str):
    def run(path, stock, patch, guard):
        from verl_npu.k8s import render

        if guard:
            patch.setattr(render, "render", no_work("the render (and its preflight)"))
        patch.chdir(REPO)  # --launch is a script in this repository
        return verl_npu("k8s", "render", kind, "--name", "n-1", "--env-file", str(stock.env_file), "--launch",
                        "examples/glm5_2/run_glm5_2_grpo_a3.sh", "--image", stock.image, "--no-preflight", "-o",
                        str(path))  # fmt: skip

    return run


def _parity_run(path, stock, patch, guard):
    from verl_npu.parity import job

    run = json.loads(stock.parity_runs["fp32"].read_text())
    patch.setattr(job, "run", no_work("the parity job") if guard else lambda options: run)  # a job: minutes
    return verl_npu("parity", "run", "--model", "dense", "--out", str(path))


def _parity_compare(option: str):
    def run(path, stock, patch, guard):
        from verl_npu.parity import compare as cmp

        runs = stock.parity_runs
        if guard:
            patch.setattr(cmp, "load", no_work("loading the runs"))
        return verl_npu("parity", "compare", str(runs["fp32"]), "--against", str(runs["fp32"]), "--model", "dense",
                        option, str(path))  # fmt: skip

    return run


def _parity_reference(path, stock, patch, guard):
    from verl_npu.parity import compare as cmp

    runs = stock.parity_runs
    if guard:
        patch.setattr(cmp, "load", no_work("loading the runs"))
    return verl_npu("parity", "reference", "--bf16", str(runs["bf16"]), "--fp32", str(runs["fp32"]), "--fp64",
                    str(runs["fp64"]), "--bf16-repeat", str(runs["bf16"]), "--fp32-repeat", str(runs["fp32"]),
                    "--out", str(path))  # fmt: skip


def _smoke(path, stock, patch, guard):
    """The all-reduce needs a Ray cluster (tests_npu/cluster/test_cluster_smoke.py runs one): its results stand in
    here."""
    from verl_npu.cluster import smoke

    ray = pytest.importorskip("ray")
    rank = {"rank": 0, "node": "n0", "device": "npu:0", "store": "10.0.0.1:29500", "seconds": 1.0}
    patch.setattr(ray, "init", no_work("ray.init") if guard else lambda **kwargs: None)
    patch.setattr(ray, "shutdown", lambda: None)
    patch.setattr(smoke, "wait_for_devices", lambda *args: {"n0": 1})
    patch.setattr(smoke, "all_reduce_everywhere", lambda *args, **kwargs: [rank])
    return call(smoke.main, "--expect", "1", "--backend", "gloo", "--json", str(path))


def _gsm8k(path, stock, patch, guard):
    from verl_npu.ci import gsm8k

    if guard:
        patch.setattr(gsm8k, "convert_split", no_work("the conversion"))
    return call(gsm8k._main, str(stock.gsm8k_raw), str(path.parent))


def _build_manifest(path, stock, patch, guard):
    from verl_npu.stack import build_manifest

    return call(build_manifest._main, "write", "--target", "dev", "--prefix", str(path.parent))


def _json(data: bytes) -> bool:
    with contextlib.suppress(ValueError):
        return json.loads(data) is not None
    return False


def _png(data: bytes) -> bool:
    return data.startswith(b"\x89PNG\r\n\x1a\n")


def _parquet(data: bytes) -> bool:
    return data[:4] == b"PAR1" and data[-4:] == b"PAR1"


# Every output path of the CLI: the command and option as a user writes them -> how it is written. A string says
# why the path is not run here.
OUTPUTS: dict[str, Output | str] = {
    "verl-npu preflight --json": Output("r.json", _preflight("--json"), _json),
    "verl-npu preflight --plot": Output("r.png", _preflight("--plot"), _png),
    "preflight cache ($VERL_NPU_CACHE_DIR/preflight/KEY.json)": Output("k.json", _preflight_cache_entry, _json),
    "verl-npu doctor --report": Output("report.md", _doctor, lambda d: d.startswith(b"# verl-npu doctor report")),
    "verl-npu ci compare --json": Output("compare.json", _ci_compare_json, _json),
    "verl-npu ci compare BASELINE --update": Output(
        "baseline.json", _ci_compare_update, lambda d: json.loads(d)["commit"] == "0123abcd"
    ),
    "verl-npu contracts verify --json": Output("contracts.json", _contracts, lambda d: isinstance(json.loads(d), list)),
    "verl-npu k8s render rayjob --output": Output("job.yaml", _k8s("rayjob"), lambda d: b"kind: RayJob" in d),
    "verl-npu k8s render volcano --output": Output("job.yaml", _k8s("volcano"), lambda d: b"kind: Job" in d),
    "verl-npu parity run --out": Output(
        "run.json", _parity_run, lambda d: json.loads(d)["kind"] == "verl-npu parity run"
    ),
    "verl-npu parity compare --json": Output("report.json", _parity_compare("--json"), _json),
    "verl-npu parity compare --plot": Output("layers.png", _parity_compare("--plot"), _png),
    "verl-npu parity reference --out": Output("reference.json", _parity_reference, _json),
    "python -m verl_npu.cluster.smoke --json": Output("ranks.json", _smoke, lambda d: json.loads(d)[0]["rank"] == 0),
    "python -m verl_npu.ci.gsm8k RAW_DIR OUT_DIR (train.parquet)": Output("train.parquet", _gsm8k, _parquet),
    "python -m verl_npu.stack.build_manifest write --prefix (build-manifest.json)": Output(
        "build-manifest.json", _build_manifest, lambda d: json.loads(d)["target"] == "dev"
    ),
    "verl-npu upstream fetch --dest": "fetches from a git URL: test_upstream.py runs it against a local mirror",
}
RUN = {name: o for name, o in OUTPUTS.items() if isinstance(o, Output)}
# the files written inside a temporary directory of the command's own are no output path:
# `k8s render`'s copy of the env file (verl_npu/k8s/render.py launch_environment) and the parity job's checkpoint
# (verl_npu/parity/models.py write_checkpoint); both go through verl_npu.atomic all the same.


def test_outputs_names_every_output_option_of_the_cli():
    """A new option that writes a file must join OUTPUTS: every option named like one, in every sub-command."""
    from verl_npu.cli import build_parser

    def options(parser: argparse.ArgumentParser, words: list[str]):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, [*words, name])
            elif action.nargs != 0 and {"--json", "--out", "--output", "--plot", "--report", "--dest"} & set(
                action.option_strings
            ):
                yield " ".join([*words, action.option_strings[-1]])

    found = set(options(build_parser(), ["verl-npu"]))
    listed = {name for name in OUTPUTS if name.startswith("verl-npu ")}
    assert found == {n for n in listed if "BASELINE" not in n}, found ^ listed


def special(path: Path) -> str:
    """A device node at ``path`` where this process may make one, else a FIFO; what the refusal calls it."""
    if make_device(path):
        return "character device"
    os.mkfifo(path)
    return "FIFO"


@pytest.mark.parametrize("what", ["device or FIFO", "directory"])
@pytest.mark.parametrize("name", list(RUN))
def test_an_output_that_is_not_a_regular_file_is_refused_before_any_work_and_left_alone(
    name, what, stock, tmp_path, monkeypatch
):
    output = RUN[name]
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / output.filename
    if what == "directory":
        path.mkdir()
        (path / "inside").write_bytes(OLD)
        kind = "directory"
    else:
        kind = special(path)
    before = identity(path)
    code, err = output.run(path, stock, monkeypatch, True)
    assert code == 2, err
    assert str(path) in err and f"is a {kind}" in err and "regular file" in err, err
    assert identity(path) == before
    if what == "directory":
        assert [p.name for p in path.iterdir()] == ["inside"] and (path / "inside").read_bytes() == OLD
    assert no_temporary_files(path.parent)


@pytest.mark.parametrize("name", list(RUN))
def test_an_output_that_is_a_symlink_to_a_regular_file_is_written_through(name, stock, tmp_path, monkeypatch):
    output = RUN[name]
    link, target, bystander = linked(tmp_path, output.filename)
    code, err = output.run(link, stock, monkeypatch, False)
    assert code in (0, 1), err  # contracts verify finds torch-npu's sources missing here: exit 1, its JSON written
    assert link.is_symlink() and os.readlink(link) == str(target), "the link was replaced"
    data = target.read_bytes()
    assert data != OLD and output.written(data), data[:200]
    assert bystander.read_bytes() == OLD and no_temporary_files(link.parent, target.parent)


@pytest.mark.parametrize("name", ["verl-npu ci compare --json", "verl-npu parity compare --json"])
def test_a_link_to_a_directory_is_refused_naming_the_directory(name, stock, tmp_path, monkeypatch):
    output = RUN[name]
    directory = tmp_path / "results"
    directory.mkdir()
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / output.filename
    link.symlink_to(directory)
    code, err = output.run(link, stock, monkeypatch, True)
    assert code == 2 and str(link) in err and f"a symlink to {directory}, which is a directory" in err, err
    assert link.is_symlink() and list(directory.iterdir()) == []


def test_a_cache_entry_that_is_not_a_regular_file_is_a_warning_and_the_check_goes_on(tmp_path, monkeypatch):
    """The cache costs speed, never the check (docs/errors.md): a FIFO where the entry goes is left alone."""
    from verl_npu.preflight import worker

    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path))
    entry = worker.cache_dir() / f"{'0' * 64}.json"
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert worker.PreflightWorker._usable_cache(entry) is None
    warning = err.getvalue()
    assert f"the preflight cache is unusable: {entry}: it is a FIFO" in warning and "--no-cache" in warning, warning
    assert stat.S_ISFIFO(os.lstat(entry).st_mode)


def test_a_cache_entry_that_turns_into_a_directory_before_the_store_is_a_warning(tmp_path, capsys):
    from verl_npu.preflight import worker

    entry = tmp_path / "k.json"
    job = object.__new__(worker.PreflightWorker)
    job._cache, job._key = entry, "k" * 64
    entry.mkdir()  # after the check in __init__, before the store
    job._store({"hf": None, "checks": [], "model_check": {}})
    err = capsys.readouterr().err
    assert f"cannot write the cache entry {entry}" in err and "is a directory" in err and entry.is_dir()


def test_the_build_manifest_script_says_why_with_exit_2(tmp_path):
    from verl_npu.stack import build_manifest

    (tmp_path / build_manifest.FILENAME).mkdir()
    code, err = call(build_manifest._main, "write", "--target", "dev", "--prefix", str(tmp_path))
    assert code == 2 and f"cannot write {tmp_path / build_manifest.FILENAME}: it is a directory" in err, err


@pytest.mark.parametrize("where", ["stamp", "raw shard"])
def test_gsm8k_never_reads_a_fifo(where, tmp_path, stock):
    """The stamp is read to decide whether the outputs are current, and each raw shard is hashed: a FIFO at
    either would block the read forever."""
    import shutil

    from verl_npu.ci import gsm8k

    raw, out = tmp_path / "raw", tmp_path / "out"
    shutil.copytree(stock.gsm8k_raw, raw)
    out.mkdir()
    fifo = out / gsm8k.STAMP if where == "stamp" else raw / "main" / "test-00001-of-00002.parquet"
    os.mkfifo(fifo)
    result = []
    thread = threading.Thread(target=lambda: result.append(call(gsm8k._main, str(raw), str(out))), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"gsm8k blocked reading a FIFO ({where})"
    code, err = result[0]
    expected = f"{fifo}: it is a FIFO" if where == "stamp" else f"{fifo}: not a regular file"
    assert code == 2 and expected in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and list(out.iterdir()) == ([fifo] if where == "stamp" else [])
