"""The CI definitions: workflows lint, every path they use exists, images only by manifest-derived tags,
every nightly job has its script and baseline and passes preflight."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl_npu.ci.compare import DEFAULT_LIMITS, read_baseline
from verl_npu.ci.images import TAG, image_tag, manifest_digest

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
EXPRESSION = re.compile(r"\$\{\{.*?\}\}")
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.ci|ci|examples|docker|tests_npu|bench)/[\w./${}-]+|install\.sh)")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def steps(workflow: dict):
    for job in workflow["jobs"].values():
        yield from job.get("steps", [])


def test_there_are_pr_image_nightly_and_multinode_workflows():
    assert {p.stem for p in WORKFLOWS} >= {"pr", "images", "nightly", "multinode"}


def test_every_workflow_validates_against_the_github_workflow_schema():
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    done = subprocess.run(
        [checker, "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_run_block_is_shellcheck_clean(tmp_path):
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    scripts = []
    for workflow in WORKFLOWS:
        for index, step in enumerate(steps(load(workflow))):
            if "run" in step:
                script = tmp_path / f"{workflow.stem}_{index}.sh"
                # GitHub substitutes ${{ }} before bash runs; shellcheck sees a plain word there
                script.write_text("#!/usr/bin/env bash\n" + EXPRESSION.sub("EXPR", step["run"]) + "\n")
                scripts.append(str(script))
    assert scripts
    done = subprocess.run([shellcheck, "--severity=style", *scripts], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def referenced_paths(text: str) -> set[str]:
    """Repository paths named in shell text (comments skipped; paths built from variables left out)."""
    code = "\n".join(line for line in EXPRESSION.sub("", text).splitlines() if not line.lstrip().startswith("#"))
    return {m.rstrip(".") for m in REPO_PATH.findall(code) if "$" not in m}


def test_every_path_a_workflow_or_ci_script_references_exists():
    texts = {p: p.read_text() for p in [*sorted((REPO / "ci").rglob("*.sh")), REPO / "ci/k8s/rayjob-multinode.yaml"]}
    texts |= {p: "\n".join(s["run"] for s in steps(load(p)) if "run" in s) for p in WORKFLOWS}
    missing = []
    for source, text in texts.items():
        for path in referenced_paths(text):
            if not (REPO / path).exists():
                missing.append(f"{source.relative_to(REPO)} -> {path}")
    for workflow in WORKFLOWS:
        for step in steps(load(workflow)):
            if step.get("uses", "").startswith("./") and not (REPO / step["uses"]).exists():
                missing.append(f"{workflow.name} uses {step['uses']}")
        for job in load(workflow)["jobs"].values():
            if job.get("uses", "").startswith("./") and not (REPO / job["uses"]).exists():
                missing.append(f"{workflow.name} uses {job['uses']}")
    assert not missing, missing
    assert "ci/nightly/run_job.sh" in referenced_paths(texts[REPO / ".github/workflows/nightly.yml"])


def nightly_jobs() -> list[str]:
    matrix = load(REPO / ".github/workflows/nightly.yml")["jobs"]["e2e"]["strategy"]["matrix"]["include"]
    return [entry["job"] for entry in matrix]


def test_every_nightly_job_has_a_script_a_baseline_with_upstreams_limits_and_calls_doctor_first():
    jobs = [*nightly_jobs(), "multinode_grpo"]
    assert set(jobs) >= {"dense_grpo_offload", "dsa_glm5_small", "ckpt_resume_offload"}
    runner = (REPO / "ci/nightly/run_job.sh").read_text()
    assert runner.index("verl-npu doctor") < runner.index('bash "$SCRIPT"') < runner.index("verl-npu ci compare")
    for job in jobs:
        assert (REPO / "ci/nightly/jobs" / f"{job}.sh").is_file(), job
        baseline = read_baseline(REPO / "ci/baselines" / f"{job}.json")
        assert baseline.window == (5, 14)
        for metric, (kind, key, amount) in DEFAULT_LIMITS.items():
            limit = baseline.limits[metric]
            assert limit.kind == kind and getattr(limit, key) == amount, (job, metric)
        assert "image" in json.loads((REPO / "ci/baselines" / f"{job}.json").read_text())
    for script in (REPO / "ci/nightly/jobs").glob("*.sh"):
        text = script.read_text()
        # a job either takes the env file itself or sources another job's launch that does
        launch = re.search(r'^source "\$\{BASH_SOURCE\[0\]%/\*\}/(\w+\.sh)"$', text, re.MULTILINE)
        base = (script.parent / launch[1]).read_text() if launch else text
        assert 'source "$NIGHTLY_DIR/nightly.env"' in base, f"{script.name} must take the shared env file"
        assert text.count("export ") == 0, f"{script.name}: shared settings belong in nightly.env"


def test_images_are_referenced_only_by_manifest_derived_tags():
    for workflow in WORKFLOWS:
        text = workflow.read_text()
        assert ":latest" not in text, workflow.name
        for job in load(workflow)["jobs"].values():
            image = (job.get("container") or {}).get("image")
            if image is not None:
                assert re.fullmatch(r"\$\{\{ needs\.images\.outputs\[matrix\.chip\] \}\}", image), image
    rayjob = (REPO / "ci/k8s/rayjob-multinode.yaml").read_text()
    assert set(re.findall(r"image: (\S+)", rayjob)) == {"${IMAGE}"}
    assert "python3 -m verl_npu.ci.images" in (REPO / "ci/images/build.sh").read_text()


def test_image_tag_is_chip_manifest_hash_and_commit(tmp_path):
    tag = image_tag("a3", "0123456789abcdef0123456789abcdef01234567")
    _, _, name = tag.rpartition("/")
    repository, _, version = name.partition(":")
    assert repository == "verl-npu" and TAG.match(version)
    assert version == f"a3-{manifest_digest()}-0123456789ab"
    changed = tmp_path / "stack.toml"
    changed.write_text(
        (REPO / "verl_npu/stack/stack.toml").read_text().replace('version = "0.9.1"', 'version = "0.9.2"')
    )
    assert manifest_digest(changed) != manifest_digest()
    assert image_tag("a3", "0123456789ab", manifest=changed).endswith(f"a3-{manifest_digest(changed)}-0123456789ab")
    with pytest.raises(ValueError, match="chip 'a9'"):
        image_tag("a9", "0123456789ab")
    with pytest.raises(ValueError, match="commit 'latest'"):
        image_tag("a3", "latest")


def test_every_nightly_and_multinode_launch_passes_preflight():
    from verl_npu.preflight import run_preflight

    for script in sorted((REPO / "ci/nightly/jobs").glob("*.sh")):
        directive = next(line for line in script.read_text().splitlines() if line.startswith("# preflight: "))
        options = shlex.split(directive.removeprefix("# preflight: "))
        chip, model = options[options.index("--chip") + 1], options[options.index("--model-config") + 1]
        report = run_preflight(script, chip=chip, model_config=str(REPO / model))
        assert report.verdict == "go", (script.name, [c for c in report.checks if c.status == "fail"])


def test_build_manifest_verify_passes_on_its_own_environment_and_names_what_differs(tmp_path):
    from verl_npu.stack import build_manifest
    from verl_npu.stack.manifest import load_stack

    stack = load_stack()
    doc = build_manifest.compose(stack, "dev", {})  # this venv, as install.sh --dev made it
    path = tmp_path / "build-manifest.json"
    path.write_text(json.dumps(doc))
    assert build_manifest.verify(stack, "dev", path) == []
    doc["versions"]["verl"]["installed"] = "0.9.0"
    doc["target"] = "a3"
    path.write_text(json.dumps(doc))
    problems = build_manifest.verify(stack, "dev", path)
    assert "target: built for 'a3', expected 'dev'" in problems
    assert "verl: build manifest records 0.9.0, the stack pins 0.9.1" in problems
