"""README.md stays true and short: current support matrix, .ci/run runs exactly its test command, under 12,000 bytes,
every relative link resolves (in README and in the pages it links), and every quoted result in bench/results/ is at
most one link away (README -> a page README links)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

from verl_npu.stack import load_stack
from verl_npu.stack.matrix import render_markdown, replace_in

README = (REPO / "README.md").read_text()


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)


def test_support_matrix_is_generated_from_the_current_manifest():
    stack = load_stack()
    assert render_markdown(stack) in README, "README support matrix is stale: run `verl-npu versions --markdown`"
    assert replace_in(README, stack) == README


def test_support_matrix_changes_when_a_pin_changes(tmp_path):
    manifest = tmp_path / "stack.toml"
    manifest.write_text(
        (REPO / "verl_npu/stack/stack.toml").read_text().replace('version = "2.10.0.post4"', 'version = "2.10.0.post7"')
    )
    assert render_markdown(load_stack(manifest)) not in README


def test_readme_has_the_two_commands_and_ci_runs_the_second():
    commands = _commands()
    assert len(commands) >= 2
    main_job, tests = commands[0], commands[1]
    assert main_job == "bash install.sh --dev && .venv/bin/verl-npu preflight examples/glm5_2/run_glm5_2_grpo_a3.sh"
    assert tests.startswith("bash install.sh --dev && ")
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert tests in ci_lines, f".ci/run must run README's test command verbatim: {tests!r}"


def test_versions_markdown_cli_prints_the_same_matrix():
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "versions", "--markdown"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == render_markdown(load_stack())


# --- a page a newcomer reads in five minutes; the details one link away -----------------------------------------------

README_LIMIT_BYTES = 12_000
RESULTS = REPO / "bench" / "results"
# What README.md itself linked or named in bench/results/ before its details moved to docs/ (issue 32): each stays
# reachable from README in one hop even if every page that quotes it were rewritten.
FORMER_README_RESULTS = (
    "accel_tests_h100.txt",
    "accel_tests_h200.txt",
    "contracts_verify.txt",
    "import_time_h100.json",
    "index_share_h200.json",
    "kernels_h200.json",
    "memory_estimate_h200.json",
    "multi_device_h200x2.json",
    "offload_h100.json",
    "parity_faults_cpu.json",
    "parity_faults_h200.json",
    "parity_topk_floor_cpu.json",
    "preflight_cold_start.json",
    "rl_step_dense_h200.json",
    "rl_step_dense_load_h200.json",
    "rl_step_dense_load_h200_again.json",
    "rl_step_glm5_bf16_load_h200.json",
    "rl_step_glm5_fp8_load_h200.json",
)
_FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _relative_links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page, outside code blocks and code spans."""
    text = _CODE_SPAN.sub("``", _FENCE.sub("", page.read_text()))
    return [target for target in _LINK.findall(text) if not _SCHEME.match(target)]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", _FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page.resolve(), anchor


def _broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in _relative_links(page):
        path, anchor = _resolve(page, target)
        if not path.is_relative_to(root.resolve()) or not path.exists():
            broken.append(f"{page.relative_to(root)}: {target} (no such file in the repository)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{page.relative_to(root)}: {target} (no heading #{anchor} in {path.name})")
    return broken


def _pages_linked_from(page: Path) -> list[Path]:
    """The Markdown files a page links (each once, in order)."""
    linked = [_resolve(page, target)[0] for target in _relative_links(page)]
    return list(dict.fromkeys(p for p in linked if p.suffix == ".md" and p.is_file() and p != page.resolve()))


def _one_hop_links(readme: Path) -> set[Path]:
    """Every file README links, and every file a page README links links."""
    pages = [readme, *_pages_linked_from(readme)]
    return {_resolve(page, target)[0] for page in pages for target in _relative_links(page)}


def _quoted_results(texts: list[str], results: Path) -> set[str]:
    """The files of bench/results/ that a text names, by path or by file name."""
    return {
        name.name
        for name in results.iterdir()
        if any(re.search(rf"(?<![\w-]){re.escape(name.name)}(?![\w])", text) for text in texts)
    }


def test_readme_is_a_five_minute_page():
    size = len(README.encode())
    assert size < README_LIMIT_BYTES, (
        f"README.md is {size} bytes, the limit is {README_LIMIT_BYTES}: move the detail into a docs/ page and link it"
    )


def test_every_relative_link_in_readme_resolves():
    assert len(_relative_links(REPO / "README.md")) >= 10  # the map of docs/ pages is there
    broken = _broken_links(REPO / "README.md")
    assert not broken, "README.md links what does not exist:\n" + "\n".join(broken)


def test_every_relative_link_in_the_pages_readme_links_resolves():
    pages = _pages_linked_from(REPO / "README.md")
    assert (REPO / "docs" / "engine.md").resolve() in pages and (REPO / "CONTRIBUTING.md").resolve() in pages
    broken = [line for page in pages for line in _broken_links(page)]
    assert not broken, "a page README.md links has a broken link (a docs/ page links ../bench/...):\n" + "\n".join(
        broken
    )


def test_readme_links_every_docs_page():
    linked = set(_pages_linked_from(REPO / "README.md"))
    unlinked = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked)
    assert not unlinked, f"docs/ pages README.md's map does not link: {unlinked}"


def test_every_quoted_result_is_at_most_one_link_from_readme():
    texts = [README, *(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))]
    quoted = _quoted_results(texts, RESULTS) | set(FORMER_README_RESULTS)
    assert set(FORMER_README_RESULTS) <= {p.name for p in RESULTS.iterdir()}, "a result README once quoted is gone"
    reachable = _one_hop_links(REPO / "README.md")
    far = sorted(name for name in quoted if (RESULTS / name).resolve() not in reachable)
    assert not far, (
        "bench/results/ files quoted in README.md or docs/ that no link from README or a page it links reaches "
        f"(link them where they are quoted): {far}"
    )


def test_the_link_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "run.json").write_text("{}")
    (tmp_path / "bench" / "results" / "other.json").write_text("{}")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n## Measured\n\n[ok](../bench/results/run.json) [moved](bench/results/run.json) "
        "[gone](missing.md) [anchor](#measured) [bad anchor](#nowhere) `[code](x.md)` [web](https://example.com)\n"
        "Quoted but not linked: other.json.\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text("[page](docs/page.md) [outside](../elsewhere.md)\n")
    assert _broken_links(page, tmp_path) == [
        "docs/page.md: bench/results/run.json (no such file in the repository)",
        "docs/page.md: missing.md (no such file in the repository)",
        "docs/page.md: #nowhere (no heading #nowhere in page.md)",
    ]
    assert _broken_links(readme, tmp_path) == ["README.md: ../elsewhere.md (no such file in the repository)"]
    results = tmp_path / "bench" / "results"
    assert _quoted_results([page.read_text()], results) == {"run.json", "other.json"}
    reachable = _one_hop_links(readme)
    assert (results / "run.json").resolve() in reachable and (results / "other.json").resolve() not in reachable
