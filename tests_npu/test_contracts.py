"""Contracts with the Ascend upstreams (verl_npu/contracts): the checker, our side of each fact, and,
in the network tier, the real torch-npu wheel and vllm-ascend sdist from PyPI."""

from __future__ import annotations

import ast
import inspect
import json
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from verl_npu import contracts
from verl_npu.contracts import torch_npu as torch_npu_facts
from verl_npu.contracts.spec import Contract, ContractSpecError, Expect, fingerprint
from verl_npu.contracts.verify import DRIFTED, MISSING, NOT_FOUND, OK, verify

REPO = Path(__file__).resolve().parent.parent


def test_ids_are_unique_and_every_component_has_contracts():
    ids = [c.id for c in contracts.ALL]
    assert len(ids) == len(set(ids))
    assert {c.component for c in contracts.ALL} == set(contracts.COMPONENTS)


def test_docs_list_every_contract_and_are_not_stale():
    from verl_npu.cli import contract_pins
    from verl_npu.contracts.docs import render_markdown
    from verl_npu.stack import load_stack

    committed = (REPO / "docs" / "ascend_contracts.md").read_text()
    expected = render_markdown(contracts.ALL, contract_pins(load_stack()))
    assert committed == expected, "docs/ascend_contracts.md is stale: verl-npu contracts list --markdown"


def test_a_malformed_contract_is_refused():
    good = dict(
        id="x", component="mindspeed", path="a.py", locator="python", symbol="f", line=1, sha256="0" * 64,
        relied_on="r", used_by="u", expects=(Expect("def f", "f exists"),),
    )  # fmt: skip
    Contract(**good)
    for change, message in (
        (dict(component="apex"), "component 'apex'"),
        (dict(locator="file"), "a symbol is needed exactly when"),
        (dict(sha256="abc"), "64 hex"),
        (dict(expects=()), "at least one expectation"),
        (dict(relied_on=" "), "relied_on must be stated"),
    ):
        with pytest.raises(ContractSpecError, match=message):
            Contract(**{**good, **change})


# --- the checker on small trees ------------------------------------------------------------------


def _tree(tmp_path: Path, body: str) -> Path:
    (tmp_path / "pkg").mkdir(parents=True, exist_ok=True)
    (tmp_path / "pkg" / "mod.py").write_text(body)
    return tmp_path


def _contract(body: str, **change) -> Contract:
    source = "def repatch(args):\n    for k, v in args.items():\n        setattr(full_args, k, v)"
    fields = dict(
        id="demo", component="mindspeed", path="pkg/mod.py", locator="python", symbol="repatch", line=1,
        sha256=fingerprint(source), relied_on="repatch sets every key", used_by="tests",
        expects=(Expect("setattr(full_args, k, v)", "every key lands on the args"),),
    )  # fmt: skip
    return Contract(**{**fields, **change})


ORIGINAL = "import os\n\n\ndef repatch(args):\n    for k, v in args.items():\n        setattr(full_args, k, v)\n"


def test_the_pinned_source_holds(tmp_path):
    (result,) = verify([_contract(ORIGINAL)], {"mindspeed": _tree(tmp_path, ORIGINAL)})
    assert result.status == OK, result.detail


def test_a_changed_source_drifts_even_when_its_facts_still_read_true(tmp_path):
    changed = ORIGINAL + "\n# a comment outside the symbol changes nothing\n"
    (same,) = verify([_contract(ORIGINAL)], {"mindspeed": _tree(tmp_path, changed)})
    assert same.status == OK
    reordered = ORIGINAL.replace("    for k, v in args.items():", "    for k, v in reversed(list(args.items())):")
    (result,) = verify([_contract(ORIGINAL)], {"mindspeed": _tree(tmp_path, reordered)})
    assert result.status == DRIFTED and "the recorded facts still read true, but review the change" in result.detail
    assert result.found_sha256 != result.contract.sha256


def test_a_broken_fact_is_named(tmp_path):
    broken = ORIGINAL.replace("setattr(full_args, k, v)", "full_args.update(args)")
    (result,) = verify([_contract(ORIGINAL)], {"mindspeed": _tree(tmp_path, broken)})
    assert result.status == DRIFTED
    assert "every key lands on the args: no longer contains 'setattr(full_args, k, v)'" in result.detail


def test_missing_file_symbol_or_component_never_pass(tmp_path):
    root = _tree(tmp_path, "def other():\n    pass\n")
    (symbol,) = verify([_contract(ORIGINAL)], {"mindspeed": root})
    assert symbol.status == MISSING and "repatch is no longer in pkg/mod.py" in symbol.detail
    (file,) = verify([_contract(ORIGINAL, path="pkg/gone.py")], {"mindspeed": root})
    assert file.status == MISSING and "pkg/gone.py is not in" in file.detail
    (component,) = verify([_contract(ORIGINAL)], {"mindspeed": None})
    assert component.status == NOT_FOUND and "not installed in this Python" in component.detail


def test_cli_verify_exit_codes_and_bad_sources(tmp_path, capsys):
    from verl_npu.cli import main

    assert main(["contracts", "verify", "--source", "nope=/tmp"]) == 2
    assert "NAME one of mindspeed, vllm-ascend, torch-npu" in capsys.readouterr().err
    # nothing of the Ascend stack is installed on this machine: every contract is not-found, exit 1
    out = tmp_path / "results.json"
    assert main(["contracts", "verify", "--component", "torch-npu", "--json", str(out)]) == 1
    results = json.loads(out.read_text())
    assert results and {r["status"] for r in results} == {NOT_FOUND}


# --- our side of the facts -----------------------------------------------------------------------


def _schema_parameters(schema: str) -> list[tuple[str, bool, object]]:
    """(name, keyword-only, default) of each parameter of a torch-npu native-function schema."""
    inside = schema[schema.index("(") + 1 : schema.index(") ->")]
    params, keyword_only = [], False
    for part in (p.strip() for p in inside.split(",")):
        if part == "*":
            keyword_only = True
            continue
        declaration, _, default = part.partition("=")
        name = declaration.split()[-1]
        value = ast.literal_eval(default) if default else inspect.Parameter.empty
        params.append((name, keyword_only, value))
    return params


def _stand_ins():
    from support import fake_torch_npu

    module = fake_torch_npu.module()
    return {name: getattr(module, name) for name in dir(module) if name.startswith("npu_")}


@pytest.mark.parametrize("op", sorted(_stand_ins()))
def test_each_torch_npu_stand_in_has_the_recorded_signature(op):
    assert op in torch_npu_facts.SCHEMAS, f"{op}: record its torch-npu schema in verl_npu/contracts/torch_npu.py"
    ours = [
        (p.name, p.kind == inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in inspect.signature(_stand_ins()[op]).parameters.values()
    ]
    assert ours == _schema_parameters(torch_npu_facts.SCHEMAS[op])


def test_the_torch_npu_calls_verl_npu_makes_name_only_recorded_parameters():
    """Every keyword verl_npu.ops.ascend passes to a torch_npu operator exists in its recorded schema
    (torch-npu 2.10.0.post4 has no ``sinks``, for example)."""
    tree = ast.parse((REPO / "verl_npu" / "ops" / "ascend.py").read_text())
    seen = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("npu_"):
            names = {name for name, _, _ in _schema_parameters(torch_npu_facts.SCHEMAS[node.func.attr])}
            assert {k.arg for k in node.keywords} <= names, (node.func.attr, {k.arg for k in node.keywords} - names)
            seen += 1
    assert seen >= 4


def test_no_env_file_image_or_forwarding_sets_the_npu_allocator_configuration():
    """vllm-ascend's sleep-mode allocator refuses expandable segments (contract
    vllm-ascend-sleep-mode-refuses-expandable-segments): nothing verl-npu ships sets the variable."""
    from verl_npu.contracts.vllm_ascend import ALLOC_CONF_VARIABLE
    from verl_npu.runtime_patches.ray_runtime_env import FORWARDED_VARIABLES

    assert ALLOC_CONF_VARIABLE not in FORWARDED_VARIABLES
    files = [*REPO.glob("docker/*"), *REPO.glob("examples/**/*.env"), *REPO.glob("ci/**/*.env")]
    files += [*REPO.glob("ci/**/*.sh"), *REPO.glob("examples/**/*.sh")]
    assert files
    assignment = re.compile(rf"^(?!\s*#).*\b{ALLOC_CONF_VARIABLE}\s*=", re.MULTILINE)
    for path in files:
        assert not assignment.search(path.read_text()), f"{path.relative_to(REPO)} sets {ALLOC_CONF_VARIABLE}"


def test_the_build_plan_passes_mindspeed_what_its_dsa_feature_reads():
    from transformers import GlmMoeDsaConfig

    from verl_npu.contracts.mindspeed import ARGS_READ_WITHOUT_DEFAULT, DSA_SWITCHES
    from verl_npu.engine.build_plan import MINDSPEED_ONLY_KEYS, build_plan

    assert set(DSA_SWITCHES) <= set(MINDSPEED_ONLY_KEYS)  # options MindSpeed registers, not megatron fields
    engine = {"vanilla_mbridge": True, "override_transformer_config": dict.fromkeys(DSA_SWITCHES, True)}
    repatch = build_plan(engine, {}, GlmMoeDsaConfig(), "ascend").mindspeed_repatch
    assert repatch["experimental_attention_variant"] == "dsa"  # contract mindspeed-dsa-applies-only-for-variant-dsa
    assert set(ARGS_READ_WITHOUT_DEFAULT) - {"context_parallel_algo"} <= set(repatch)
    # context_parallel_algo has a MindSpeed option (so a default); the DSA CP rules need it only with CP > 1


# --- the real artifacts ------------------------------------------------------------------------------


@pytest.mark.network
def test_the_torch_npu_wheel_on_pypi_holds_every_recorded_fact(tmp_path):
    from support.pypi import download

    from verl_npu.stack import load_stack

    version = load_stack().packages["torch-npu"].version
    wheel = download("torch-npu", lambda name: name.endswith(f"-{version}-cp312-cp312-manylinux_2_28_aarch64.whl"),
                     tmp_path / "dl")  # fmt: skip
    root = tmp_path / "torch-npu"
    wanted = {c.path for c in contracts.ALL if c.component == "torch-npu"}
    with zipfile.ZipFile(wheel) as archive:
        for member in wanted:
            archive.extract(member, root)
    results = verify(contracts.ALL, {"torch-npu": root}, components=["torch-npu"])
    assert results and all(r.ok for r in results), [(r.contract.id, r.detail) for r in results if not r.ok]


@pytest.mark.network
def test_the_vllm_ascend_sdist_on_pypi_holds_every_recorded_fact(tmp_path):
    """PyPI's vllm-ascend 0.23.0 sdist is built from tag v0.23.0, the pinned commit."""
    from support.pypi import RELEASE_OF_COMMIT, sdist

    from verl_npu.stack import load_stack

    archive = sdist("vllm-ascend", RELEASE_OF_COMMIT[load_stack().git["vllm-ascend"].commit], tmp_path / "dl")
    root = tmp_path / "vllm-ascend"
    wanted = {c.path for c in contracts.ALL if c.component == "vllm-ascend"}
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        for member in wanted:
            tar.extract(f"{top}/{member}", tmp_path, filter="data")
    shutil.move(tmp_path / top, root)
    results = verify(contracts.ALL, {"vllm-ascend": root}, components=["vllm-ascend"])
    assert results and all(r.ok for r in results), [(r.contract.id, r.detail) for r in results if not r.ok]


@pytest.mark.parametrize("target", ["a2", "a3"])
def test_every_ascend_image_build_checks_the_contracts_after_installing_and_before_the_build_manifest(target):
    from verl_npu.stack import load_stack
    from verl_npu.stack.plan import install_plan

    kinds = [step.kind for step in install_plan(load_stack(), target)]
    assert kinds.index("git") < kinds.index("local") < kinds.index("contracts") < kinds.index("build-manifest")
    assert "contracts" not in [step.kind for step in install_plan(load_stack(), "dev")]  # nothing Ascend there
    install_sh = (REPO / "install.sh").read_text()
    assert (
        '"$PY" -m verl_npu.cli contracts verify ||' in install_sh and "contracts) run_contracts_step ;;" in install_sh
    )
