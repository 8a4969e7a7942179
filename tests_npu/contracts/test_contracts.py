"""Contracts with the upstreams (verl_npu/contracts): the checker, our side of each fact (verl's GLM-5.2
rollout patch included), and, in the network tier, the real torch-npu wheel and the vllm-ascend and vLLM
sdists from PyPI."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu import contracts
from verl_npu.contracts import torch_npu as torch_npu_facts
from verl_npu.contracts.spec import Contract, ContractSpecError, Expect, fingerprint, squash
from verl_npu.contracts.verify import DRIFTED, MISSING, NOT_FOUND, OK, verify


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


def test_expectations_ignoring_whitespace_and_matching_the_end_or_the_whole_source(tmp_path):
    """The forms verl's GLM-5.2 patch checks sources with (whitespace removed; ``in``, ``endswith``, ``==``)."""
    original = "def wake_up(self, tags=None):\n    if tags:\n        wake(tags)\n    resume()\n"
    expects = (
        Expect("if tags: wake(tags)", "wakes", ignore_whitespace=True),
        Expect("resume()", "resumes last", match="ends-with", ignore_whitespace=True),
        Expect(
            "def wake_up(self,tags=None):if tags:wake(tags) resume()", "whole", match="equals", ignore_whitespace=True
        ),
        Expect("if not asleep: resume()", "the fix is not upstream", present=False, ignore_whitespace=True),
    )
    contract = _contract(original, symbol="wake_up", sha256=fingerprint(original.strip()), expects=expects)
    (held,) = verify([contract], {"mindspeed": _tree(tmp_path, original)})
    assert held.status == OK, held.detail
    assert not Expect("if tags: wake(tags)", "exact text").holds(original)  # whitespace counts by default
    fixed = original.replace("    resume()", "    if not asleep:\n        resume()\n    log()")
    (result,) = verify([contract], {"mindspeed": _tree(tmp_path, fixed)})
    assert result.status == DRIFTED
    assert "resumes last: no longer ends with 'resume()' (whitespace ignored)" in result.detail
    assert "whole: no longer equals" in result.detail
    assert "the fix is not upstream: now contains 'if not asleep: resume()'" in result.detail
    with pytest.raises(ContractSpecError, match="match 'starts-with'"):
        Expect("x", "y", match="starts-with")


def test_grep_reads_one_file_as_well_as_a_directory(tmp_path):
    root = _tree(tmp_path, "class A:\n    def run(self):\n        pass\n\n\nclass B(A):\n    pass\n")
    (tmp_path / "pkg" / "other.py").write_text("def run(self):\n    pass\n")
    hits = "pkg/mod.py: class A:\npkg/mod.py: def run(self):\npkg/mod.py: class B(A):"
    one_file = _contract(hits, locator="grep", path="pkg/mod.py", symbol=r"^class |def run\(",
                         sha256=fingerprint(hits), expects=(Expect(hits, "run is A's only"),))  # fmt: skip
    (result,) = verify([one_file], {"mindspeed": root})
    assert result.status == OK, result.detail
    (whole,) = verify([dataclasses.replace(one_file, path="pkg")], {"mindspeed": root})
    assert whole.status == DRIFTED and whole.found_sha256 != one_file.sha256  # other.py's run counts there


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
    wheel = download("torch-npu", lambda name: name.endswith(f"-{version}-cp312-cp312-manylinux_2_28_aarch64.whl"))
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
    from support.pypi import RELEASE_OF_COMMIT, extract, sdist

    from verl_npu.stack import load_stack

    archive = sdist("vllm-ascend", RELEASE_OF_COMMIT[load_stack().git["vllm-ascend"].commit])
    root = tmp_path / "vllm-ascend"
    for path in sorted({c.path for c in contracts.ALL if c.component == "vllm-ascend"}):
        extract(archive, path, root)  # a file, or a directory a grep contract reads whole
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


# --- verl 0.9.1's GLM-5.2 rollout patch (VERL_VLLM_ASCEND_GLM52_PATCH) -------------------------------


def _verl_glm52_patch_source() -> str:
    import importlib.util

    # read, not imported: verl.utils.vllm needs vLLM's dependencies, which the dev box does not have
    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations
    return (Path(next(iter(spec.submodule_search_locations))) / "utils" / "vllm" / "npu_vllm_patch.py").read_text()


class _VerlPatchReader:
    """What verl's GLM-5.2 patch does, read from its source (``apply_npu_vllm_patches``' GLM-5.2 branch and every
    module-level function it reaches).

    Names are resolved through the patch functions' imports, assignments and call arguments to the dotted
    names of the vllm / vllm_ascend objects they stand for. Collected:

    * ``replaced``: the objects it assigns to (patched attributes); ``imported``: modules it imports;
    * ``checks``: (object, kind, text) for each string it compares an object's whitespace-free source with
      (kind: "contains" for ``in`` / ``not in``, "ends-with", "equals");
    * ``signatures``: (object, parameter names) for each parameter tuple it compares a signature with.
    """

    UPSTREAMS = ("vllm.", "vllm_ascend.")

    def __init__(self, source: str):
        self.tree = ast.parse(source)
        self.functions = {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)}
        self.replaced: set[str] = set()
        self.imported: set[str] = set()
        self.checks: set[tuple[str, str, str]] = set()
        self.signatures: set[tuple[str, tuple[str, ...]]] = set()
        root = self._glm52_branch()
        self._visit_statements("apply_npu_vllm_patches", root, {})

    def _glm52_branch(self) -> list[ast.stmt]:
        main = self.functions["apply_npu_vllm_patches"]
        for node in ast.walk(main):
            if (
                isinstance(node, ast.If)
                and isinstance(node.test, ast.Call)
                and getattr(node.test.func, "id", None) == "_glm52_patch_enabled"
            ):
                return node.body
        raise AssertionError("verl's apply_npu_vllm_patches has no `if _glm52_patch_enabled():` branch any more")

    @staticmethod
    def _dotted(node: ast.AST, scope: dict[str, object]) -> str | None:
        if isinstance(node, ast.Name):
            value = scope.get(node.id)
            return value if isinstance(value, str) else None
        if isinstance(node, ast.Attribute):
            base = _VerlPatchReader._dotted(node.value, scope)
            return f"{base}.{node.attr}" if base else None
        return None

    def _upstream(self, dotted: str | None) -> bool:
        return dotted is not None and dotted.startswith(self.UPSTREAMS)

    def _visit_function(self, name: str, bindings: dict[str, object], seen: set[str]) -> None:
        key = f"{name}:{sorted((k, str(v)) for k, v in bindings.items())}"
        if key in seen:
            return
        seen.add(key)
        self._visit_statements(name, self.functions[name].body, bindings, seen)

    def _visit_statements(self, name, body, bindings, seen=None) -> None:
        seen = set() if seen is None else seen
        scope: dict[str, object] = dict(bindings)
        module = ast.Module(body=list(body), type_ignores=[])
        nodes = sorted(ast.walk(module), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
        sources: dict[str, str] = {}  # local name -> the object whose normalised source it holds
        signatures: dict[str, str] = {}  # local name -> the object whose parameter names it holds
        for node in nodes:
            if isinstance(node, ast.ImportFrom | ast.Import):
                self._visit_import(node, scope)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                self._visit_assign(node.targets[0], node.value, scope, sources, signatures)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1:
                self._compare(node, scope, sources, signatures)
            elif isinstance(node, ast.Call):
                self._visit_call(name, node, scope, sources, seen)

    def _visit_import(self, node, scope) -> None:
        if isinstance(node, ast.ImportFrom):
            if node.module:
                for alias in node.names:
                    scope[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            return
        for alias in node.names:
            if alias.asname:
                scope[alias.asname] = alias.name
            elif alias.name.startswith(self.UPSTREAMS):
                self.imported.add(alias.name)

    def _visit_assign(self, target, value, scope, sources, signatures) -> None:
        if isinstance(target, ast.Attribute):
            dotted = self._dotted(target, scope)
            if self._upstream(dotted):
                self.replaced.add(dotted)
        elif isinstance(target, ast.Name):
            if isinstance(value, ast.Constant | ast.Tuple):
                with contextlib.suppress(ValueError):  # a tuple of non-literals names nothing we follow
                    scope[target.id] = ast.literal_eval(value)
            elif (read := self._source_read(value, scope)) is not None:
                sources[target.id] = read
            elif (read := self._signature_read(value, scope, signatures)) is not None:
                signatures[target.id] = read
            elif (dotted := self._dotted(value, scope)) is not None:
                scope[target.id] = dotted

    def _visit_call(self, name, node, scope, sources, seen) -> None:
        func = node.func
        holder = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        if _attribute_name(func) == "endswith" and holder in sources:
            self.checks.add((sources[holder], "ends-with", self._text(node.args[0], scope)))
        callee = getattr(func, "id", None)
        if callee in self.functions and callee not in ("_normalized_source", name):
            params = [a.arg for a in self.functions[callee].args.args]
            passed = {p: self._dotted(a, scope) for p, a in zip(params, node.args, strict=False)}
            self._visit_function(callee, {k: v for k, v in passed.items() if v}, seen)

    def _source_read(self, node: ast.AST, scope) -> str | None:
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_normalized_source":
            return self._dotted(node.args[0], scope)
        return None

    def _signature_read(self, node: ast.AST, scope, signatures) -> str | None:
        """``tuple(inspect.signature(X).parameters)`` (possibly sliced) -> X."""
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Call)
                and isinstance(inner.func, ast.Attribute)
                and inner.func.attr == "signature"
                and getattr(inner.func.value, "id", None) == "inspect"
            ):
                return self._dotted(inner.args[0], scope)
            if isinstance(inner, ast.Name) and inner.id in signatures:
                return signatures[inner.id]
        return None

    @staticmethod
    def _text(node: ast.AST, scope) -> object:
        if isinstance(node, ast.Name):
            return scope[node.id]
        return ast.literal_eval(node)

    def _compare(self, node: ast.Compare, scope, sources, signatures) -> None:
        left, op, right = node.left, node.ops[0], node.comparators[0]
        if isinstance(op, ast.In | ast.NotIn):
            holder = right.id if isinstance(right, ast.Name) else None
            if holder in sources:
                self.checks.add((sources[holder], "contains", self._text(left, scope)))
            return
        if not isinstance(op, ast.Eq | ast.NotEq):
            return
        for one, other in ((left, right), (right, left)):
            read = self._source_read(one, scope) or (sources.get(one.id) if isinstance(one, ast.Name) else None)
            if read is not None:
                self.checks.add((read, "equals", self._text(other, scope)))
                return
            target = self._signature_read(one, scope, signatures)
            if target is not None:
                self.signatures.add((target, tuple(self._text(other, scope))))
                return


def _attribute_name(func: ast.AST) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else None


def _def_parameters(text: str) -> tuple[str, ...] | None:
    """The parameter names of a ``def`` header recorded as an expectation (possibly cut after a parameter)."""
    header = text.strip()
    if not header.startswith("def "):
        return None
    if header.endswith(","):
        header = header[:-1] + "):"
    try:
        function = ast.parse(header + "\n    pass").body[0]
    except SyntaxError:
        return None
    return tuple(a.arg for a in function.args.posonlyargs + function.args.args)


@pytest.fixture(scope="module")
def verl_glm52_patch() -> _VerlPatchReader:
    return _VerlPatchReader(_verl_glm52_patch_source())


def test_the_reader_finds_what_verls_glm52_patch_does(verl_glm52_patch):
    """Guards the reader itself: the patch targets and checks verl 0.9.1 has, read from its source."""
    assert "vllm_ascend.ops.layernorm.AscendRMSNorm.forward_oot" in verl_glm52_patch.replaced
    assert "vllm.v1.engine.core.EngineCoreProc.run_engine_core" in verl_glm52_patch.replaced
    assert "vllm_ascend.device_allocator.camem.CaMemAllocator.sleep" in verl_glm52_patch.replaced
    assert verl_glm52_patch.imported == {"vllm_ascend.patch.worker.patch_routed_experts_capture"}
    assert (
        "vllm_ascend.attention.sfa_v1.AscendSFAImpl.process_weights_after_loading",
        "contains",
        "dispose_layer(self.kv_b_proj)",
    ) in verl_glm52_patch.checks
    assert ("vllm.v1.engine.core.EngineCore.wake_up", "ends-with", "self.resume_scheduler()") in verl_glm52_patch.checks
    assert ("vllm.v1.engine.core.EngineCore.wake_up", ("self", "tags")) in verl_glm52_patch.signatures
    prefix = ("sfa_impl", "q_li", "q_li_scale", "q_li_shape_ori", "weights")
    target = "vllm_ascend.attention.sfa_v1.DeviceOperator.indexer_select_post_process"
    assert (target, prefix) in verl_glm52_patch.signatures
    assert len(verl_glm52_patch.checks) >= 12


def test_every_target_and_check_of_verls_glm52_patch_is_a_recorded_contract(verl_glm52_patch):
    """verl's GLM-5.2 patch raises only when a rollout starts; every object it patches and every source text it
    requires is recorded as a contract (verified at image build and by doctor), so that a verl upgrade that
    changes its checks fails here instead."""
    touched = (
        verl_glm52_patch.replaced
        | verl_glm52_patch.imported
        | {target for target, _, _ in verl_glm52_patch.checks}
        | {target for target, _ in verl_glm52_patch.signatures}
    )
    mapping = contracts.VERL_GLM52_PATCH_TARGETS
    assert touched == set(mapping), (
        f"not recorded: {sorted(touched - set(mapping))}; no longer touched by verl: {sorted(set(mapping) - touched)}"
    )
    for target, ids in mapping.items():
        assert {contracts.by_id(i).component for i in ids} <= {"vllm", "vllm-ascend"}, target

    def expectations(target):
        return [e for i in mapping[target] for e in contracts.by_id(i).expects]

    for target, kind, text in sorted(verl_glm52_patch.checks):
        covered = [
            e for e in expectations(target) if e.match == kind and squash(e.text) == text and e.ignore_whitespace
        ]
        assert covered, f"verl checks that {target}'s source {kind} {text!r}: record it (whitespace ignored)"
    for target, names in sorted(verl_glm52_patch.signatures):
        recorded = [_def_parameters(e.text) for e in expectations(target)]
        assert any(p is not None and p[: len(names)] == names for p in recorded), (
            f"verl checks {target}'s parameters start with {names}: record its def line"
        )


def test_verls_glm52_switch_and_its_values_are_ours():
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE

    values = {}
    for node in ast.parse(_verl_glm52_patch_source()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    assert values["_GLM52_PATCH_ENV"] == GLM52_PATCH_VARIABLE
    assert values["_GLM52_PATCH_TRUTHY_VALUES"] == set(GLM52_PATCH_ON_VALUES)


def test_the_glm5_2_env_file_turns_verls_glm52_patch_on_and_ray_workers_get_it(monkeypatch):
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE
    from verl_npu.runtime_patches.ray_runtime_env import FORWARDED_VARIABLES, _build, env_file_variables

    shipped = env_file_variables(str(REPO / "examples" / "glm5_2" / "glm5_2.env"))
    assert shipped[GLM52_PATCH_VARIABLE].strip().lower() in GLM52_PATCH_ON_VALUES
    assert GLM52_PATCH_VARIABLE in FORWARDED_VARIABLES
    monkeypatch.delenv("VERL_NPU_ENV_FILE", raising=False)
    monkeypatch.setenv(GLM52_PATCH_VARIABLE, "1")
    runtime_env = _build(lambda: {"env_vars": {}})()  # the wrapper the ray-runtime-env patch installs
    assert runtime_env["env_vars"][GLM52_PATCH_VARIABLE] == "1"


# --- vLLM -----------------------------------------------------------------------------------------


def test_vllm_ascends_no_indexer_rule_follows_top_k_reuse_and_indexer_types():
    """layers_without_indexer: vllm-ascend's patch_deepseek_v2 (contract
    vllm-ascend-glm5-shared-layers-have-no-indexer)."""
    import json
    import types

    from verl_npu.contracts.vllm_ascend import layers_without_indexer, reuses_topk

    glm5_2 = types.SimpleNamespace(**json.loads((REPO / "examples" / "glm5_2" / "config.json").read_text()))
    shared = tuple(i for i, kind in enumerate(glm5_2.indexer_types) if kind == "shared")
    assert len(shared) == 57 and layers_without_indexer(glm5_2) == shared  # the published config agrees with itself
    glm5 = types.SimpleNamespace(num_hidden_layers=4)  # no indexer_types: an indexer everywhere
    assert layers_without_indexer(glm5) == () and not any(reuses_topk(glm5, i) for i in range(4))
    # indexer_types says shared, but nothing tells vllm-ascend to reuse top-k there (freq default 1): indexer kept
    listed_only = types.SimpleNamespace(num_hidden_layers=3, indexer_types=["full", "shared", "shared"])
    assert layers_without_indexer(listed_only) == ()
    pattern = types.SimpleNamespace(
        num_hidden_layers=3, indexer_types=["full", "shared", "full"], index_topk_pattern="FSS"
    )
    assert layers_without_indexer(pattern) == (1,)


@pytest.mark.network
def test_the_vllm_sdist_on_pypi_holds_every_recorded_fact(tmp_path):
    """The vLLM the stack pins (git.vllm v0.23.0), from its PyPI sdist."""
    from support.pypi import extract, sdist

    from verl_npu.stack import load_stack

    archive = sdist("vllm", load_stack().git["vllm"].version)
    root = tmp_path / "vllm"
    for path in sorted({c.path for c in contracts.ALL if c.component == "vllm"}):
        extract(archive, path, root)
    results = verify(contracts.ALL, {"vllm": root}, components=["vllm"])
    assert results and all(r.ok for r in results), [(r.contract.id, r.detail) for r in results if not r.ok]


def test_contracts_verify_reports_the_composed_check_whatever_its_process_did(monkeypatch):
    """Where MindSpeed is installed, `contracts verify` adds the composed checks' rows (verl_npu.contracts.composed,
    executed for real over MindSpeed in tests_npu/patching/test_ascend_sim_mindspeed.py): a report becomes rows, a
    process that dies without one is one failed row with its exit and its last line."""
    from verl_npu import processes
    from verl_npu.cli import COMPOSED_WHERE, composed_checks
    from verl_npu.contracts import composed

    def returning(code: int, stdout: str, stderr: str = ""):
        return lambda argv, **_: processes.Result(tuple(argv), code, stdout, stderr)

    report = json.dumps([{"id": composed.CP_CONFIG, "ok": False, "detail": "AssertionError: CP"}])
    monkeypatch.setattr(processes, "run", returning(1, "log line\n" + report))
    assert composed_checks() == [
        {"id": composed.CP_CONFIG, "component": "mindspeed", "where": COMPOSED_WHERE,
         "status": "failed", "detail": "AssertionError: CP"}
    ]  # fmt: skip
    crash = "Traceback (most recent call last):\nImportError: no torch_npu"
    monkeypatch.setattr(processes, "run", returning(1, "", crash))
    (row,) = composed_checks()
    assert row["status"] == "failed" and "exited 1" in row["detail"] and "ImportError: no torch_npu" in row["detail"]


# --- R3: the routes the rollout returns (verl_npu/preflight/router_replay.py) ----------------------------------------


def test_router_replays_contracts_are_recorded_and_name_it():
    """Every contract preflight's R3 checks list is recorded, says that preflight relies on it, and the config keys
    preflight reads for the capturer are the ones the recorded vLLM source reads, in its order."""
    from verl_npu.preflight import router_replay

    assert len(set(router_replay.CONTRACTS)) == len(router_replay.CONTRACTS)
    for contract_id in router_replay.CONTRACTS:
        assert "verl_npu/preflight/router_replay.py" in contracts.by_id(contract_id).used_by, contract_id
    recorded = " ".join(e.text for e in contracts.by_id("vllm-routes-capturer-config-keys").expects)
    assert re.findall(r'getattr\(hf_config, "(\w+)"', recorded) == list(router_replay.EXPERTS_PER_TOKEN_KEYS)
    (keys,) = re.findall(r"for key in (\(.*?\)):", recorded)
    assert ast.literal_eval(keys) == router_replay.EXPERT_COUNT_KEYS


# verl 0.9.1's side of R3, read from the installed verl (verl is not a contract component: every environment that
# runs verl-npu installs the pinned wheel, so the CPU tier checks it here): in <file> <function>, the statements that
# run under <condition>.
VERL_R3_FACTS = (
    (
        "workers/rollout/vllm_rollout/vllm_async_server.py",
        "vLLMHttpServer.launch_server",
        "self.config.enable_rollout_routing_replay",
        "args.update({'enable_return_routed_experts': True})",
        "verl starts vLLM with enable_return_routed_experts when the rollout is asked for routes",
    ),
    (
        "workers/rollout/vllm_rollout/vllm_async_server.py",
        "vLLMHttpServer.launch_server",
        "self._disaggregation_role != 'null'",
        "args['kv_transfer_config'] = json.dumps(self._disaggregation_kv_transfer_config)",
        "disaggregation hands vLLM a KV connector (which vLLM refuses with the routes)",
    ),
    (
        "workers/rollout/vllm_rollout/vllm_async_server.py",
        "vLLMHttpServer.generate",
        "self.config.enable_rollout_routing_replay",
        "routed_experts = final_res.outputs[0].routed_experts",
        "verl reads the finished request's routes back",
    ),
    (
        "experimental/agent_loop/agent_loop.py",
        "AgentLoopOutput.as_dict",
        "routed_experts is not None",
        "routed_experts = torch.tensor(routed_experts, dtype=torch.int16)",
        "verl keeps them as int16 (preflight's host RAM estimate)",
    ),
    (
        "experimental/agent_loop/agent_loop.py",
        "AgentLoopOutput.as_dict",
        "routed_experts is not None",
        "total_length = output['prompts'].size(0) + output['responses'].size(0)",
        "one row per prompt and response token",
    ),
)


def _verl_fact_breaks(source: str, symbol: str, condition: str, statement: str) -> str | None:
    """Why ``source`` no longer runs ``statement`` under ``if condition:`` in ``symbol`` (None: it does)."""
    from verl_npu.contracts.spec import SymbolNotFound, _python_symbol

    try:
        function, _ = _python_symbol(source, symbol)
    except SymbolNotFound:
        return f"{symbol} is gone"
    branches = [
        node
        for node in ast.walk(ast.parse(function))
        if isinstance(node, ast.If) and ast.unparse(node.test) == condition
    ]
    if not branches:
        return f"{symbol} no longer tests {condition}"
    if not any(statement in ast.unparse(node) for node in branches):
        return f"{symbol} no longer runs {statement!r} when {condition}"
    return None


def _verl_source(relative: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


@pytest.mark.parametrize("fact", VERL_R3_FACTS, ids=[f[-1] for f in VERL_R3_FACTS])
def test_verl_asks_for_the_routes_reads_them_back_and_keeps_them(fact):
    path, symbol, condition, statement, _ = fact
    source = _verl_source(path)
    assert _verl_fact_breaks(source, symbol, condition, statement) is None
    # the same check on a verl that stopped doing it: named, not passed
    drifted = source.replace(statement.replace("'", '"'), "pass")
    assert drifted != source, "the statement is written with double quotes in verl's source"
    assert _verl_fact_breaks(drifted, symbol, condition, statement) == (
        f"{symbol} no longer runs {statement!r} when {condition}"
    )


# Each R3 contract, broken the way an upstream change would break it: (contract, file, text, replacement, the fact
# the verification must name). The pinned sources hold every contract (the sdist tests above); these show each one
# fails on the drift that would change a preflight verdict.
R3_DRIFTS = (
    ("vllm-ascend-runner-makes-the-routes-capturer-with-the-kv-cache", "vllm_ascend/worker/model_runner_v1.py",
     "    def _bind_routed_experts_capturer(self, capturer=None) -> None:",
     "    def init_routed_experts_capturer(self):\n        pass\n\n"
     "    def _bind_routed_experts_capturer(self, capturer=None) -> None:",
     "vLLM's method, not a replacement"),
    ("vllm-ascend-runner-binds-the-routes-capturer-to-every-fused-moe", "vllm_ascend/worker/model_runner_v1.py",
     "if isinstance(module, FusedMoE):", "if isinstance(module, AscendMoERunner):",
     "every FusedMoE layer gets the capturer"),
    ("vllm-ascend-unquantized-moe-captures-the-routes-it-dispatches", "vllm_ascend/ops/fused_moe/fused_moe.py",
     "capturer.capture(layer_id=layer.layer_id, topk_ids=topk_ids)", "pass",
     "captures the selected routes, before anything rewrites them"),
    ("vllm-ascend-quantized-moe-methods-never-capture", "vllm_ascend/quantization/methods/w8a8_dynamic.py",
     "            topk_weights, topk_ids = select_experts(",
     "            layer._ascend_routed_experts_capturer.capture(layer_id=layer.layer_id, topk_ids=topk_ids)\n"
     "            topk_weights, topk_ids = select_experts(",
     "no quantized method captures the routes"),
    ("vllm-ascend-ep-moe-communication", "vllm_ascend/ascend_forward_context.py",
     "moe_comm_type = MoECommType.ALLGATHER\n    elif", "moe_comm_type = MoECommType.ALLTOALL\n    elif",
     "no EP: all-gather"),
    ("vllm-ascend-all2all-moe-routes-a-tp-slice", "vllm_ascend/ops/fused_moe/prepare_finalize.py",
     "router_logits = split_router_logits[self.tp_rank]", "router_logits = router_logits",
     "a rank routes its slice"),
    ("vllm-ascend-mc2-moe-routes-a-tp-slice", "vllm_ascend/ops/fused_moe/prepare_finalize.py",
     "target_pad_length = _EXTRA_CTX.padded_num_tokens", "target_pad_length = self.num_tokens", "padded first"),
    ("vllm-ascend-routes-capture-gathers-tp-slices", "vllm_ascend/patch/worker/patch_routed_experts_capture.py",
     "                or n == token_num_per_dp // self.tp_size\n", "",
     "the shorter all-to-all slice (vLLM's capture raises)"),
    ("vllm-ascend-routed-experts-capture-patch", "vllm_ascend/patch/worker/patch_routed_experts_capture.py",
     "RoutedExpertsCapturer.capture = capture", "", "replaced at import"),
    ("vllm-ascend-routes-capture-patch-only-for-vllm-main", "vllm_ascend/patch/worker/__init__.py",
     "if _V2_MODEL_RUNNER_SUPPORTED:\n    import vllm_ascend.patch.worker.patch_routed_experts_capture",
     "import vllm_ascend.patch.worker.patch_routed_experts_capture", "never imported unconditionally"),
    ("vllm-routes-capturer-config-keys", "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
     'val = getattr(hf_config, "top_k_experts", None)', 'val = getattr(hf_config, "moe_topk", None)',
     "top-k, second name"),
    ("vllm-routes-capturer-buffer", "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
     "                hf_config.num_hidden_layers,\n", "                num_moe_layers,\n",
     "tokens x every decoder layer x top-k"),
    ("vllm-routes-capture-by-absolute-layer", "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
     "                and n == (token_num_per_dp + self.tp_size - 1) // self.tp_size\n",
     "                and n == (token_num_per_dp + self.tp_size - 1) // self.tp_size\n"
     "                or n == token_num_per_dp // self.tp_size\n",
     "the shorter all-to-all slice is not accepted at our pin (vllm-ascend's capture accepts it)"),
    ("vllm-fused-moe-layer-id-is-its-decoder-layer", "vllm/model_executor/layers/fused_moe/layer.py",
     "return extract_layer_index(self.layer_name)", "return self.moe_layer_index", "from the module's name"),
    ("vllm-runner-binds-the-routes-capturer-it-makes", "vllm/v1/worker/gpu_model_runner.py",
     "        self._bind_routed_experts_capturer(self.routed_experts_capturer)\n", "",
     "bound by an overridable method"),
    ("vllm-routes-per-request-prompt-then-forwarded-tokens", "vllm/v1/core/sched/scheduler.py",
     "request.num_prompt_tokens,\n                        token_start=prompt_start,",
     "request.num_tokens,\n                        token_start=prompt_start,",
     "the prompt's routes when its prefill completes"),
    ("vllm-routes-joined-when-the-request-finishes", "vllm/v1/engine/output_processor.py",
     "if finished and self.routed_experts_chunks:", "if self.routed_experts_chunks:",
     "joined along the tokens at the end"),
    ("vllm-routes-refused-with-pipeline-parallelism-or-a-kv-connector", "vllm/config/vllm.py",
     '"pipeline parallelism (PP > 1)."', '"pipeline parallelism (PP > 1) unless the routes are gathered."',
     "refused with PP > 1"),
    ("vllm-dp-metadata-only-with-data-parallelism", "vllm/forward_context.py",
     "vllm_config.parallel_config.data_parallel_size > 1\n", "vllm_config.parallel_config.data_parallel_size >= 1\n",
     "DP metadata only with DP > 1"),
)  # fmt: skip


@pytest.fixture(scope="module")
def r3_pinned_sources(tmp_path_factory) -> dict[str, Path]:
    """The files of the R3 contracts from the pinned vLLM and vllm-ascend sdists."""
    from support.pypi import contract_sources

    from verl_npu.preflight.router_replay import CONTRACTS

    return contract_sources(CONTRACTS, tmp_path_factory.mktemp)


def test_every_r3_contract_has_a_drift_case():
    from verl_npu.preflight.router_replay import CONTRACTS

    assert sorted(case[0] for case in R3_DRIFTS) == sorted(CONTRACTS)


@pytest.mark.network
@pytest.mark.parametrize("case", R3_DRIFTS, ids=[case[0] for case in R3_DRIFTS])
def test_each_r3_contract_fails_when_upstream_drifts(case, r3_pinned_sources, tmp_path):
    contract_id, path, text, replacement, fact = case
    contract = contracts.by_id(contract_id)
    pinned = r3_pinned_sources[contract.component]
    (held,) = verify([contract], {contract.component: pinned})
    assert held.status == OK, held.detail
    drifted = tmp_path / contract.component
    shutil.copytree(pinned, drifted)
    source = (drifted / path).read_text()
    assert source.count(text) >= 1, f"{path} no longer has {text!r}: update the drift case"
    (drifted / path).write_text(source.replace(text, replacement, 1))
    (result,) = verify([contract], {contract.component: drifted})
    assert result.status == DRIFTED
    assert f"{fact}: " in result.detail, result.detail
