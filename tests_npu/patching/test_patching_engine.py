"""The patch engine on synthetic target modules: identity, aliases, idempotency, refusals."""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
import textwrap
import warnings

import pytest

from verl_npu.patching import (
    APPLIED,
    APPLIED_WITH_WARNING,
    PENDING,
    SKIPPED,
    Patch,
    PatchConflictError,
    PatchDriftError,
    PatchEngine,
    PatchMismatchWarning,
    PatchSpecError,
    PatchVersionError,
    source_fingerprint,
)

TARGET_SOURCE = """
def greet(name):
    return "hello " + name


class Greeter:
    def greet(self, name):
        return "hi " + name
"""


@pytest.fixture
def fake_pkg(tmp_path, monkeypatch):
    """A package `vnpu_fake` with a target module and two modules holding aliases of its function."""
    pkg = tmp_path / "vnpu_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "target.py").write_text(textwrap.dedent(TARGET_SOURCE))
    (pkg / "user_a.py").write_text("from vnpu_fake.target import greet\n")
    (pkg / "user_b.py").write_text("from vnpu_fake import target\nsay = target.greet\n")
    (pkg / "later.py").write_text("def late():\n    return 'late'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith("vnpu_fake")]:
        del sys.modules[name]


def make_patch(**overrides) -> Patch:
    target_mod = importlib.import_module("vnpu_fake.target")
    fields = dict(
        id="greet-louder",
        target="vnpu_fake.target:greet",
        kind="wrap",
        platforms=frozenset({"cpu", "cuda", "ascend"}),
        requires={"pytest": ">=7"},
        source_sha256=source_fingerprint(target_mod.greet),
        reason="test",
        upstream="tests",
        remove_when="never",
        build=lambda original: lambda name: original(name).upper(),
    )
    fields.update(overrides)
    return Patch(**fields)


def test_apply_apply_revert_apply_keeps_every_alias_consistent(fake_pkg):
    target = importlib.import_module("vnpu_fake.target")
    user_a = importlib.import_module("vnpu_fake.user_a")
    user_b = importlib.import_module("vnpu_fake.user_b")
    original = target.greet
    engine = PatchEngine("cpu", allow_mismatch=False)
    patch = make_patch()

    record = engine.apply(patch)
    patched = target.greet
    assert record.status == APPLIED and "2 aliases rebound" in record.detail
    assert patched is not original and user_a.greet is patched and user_b.say is patched
    assert patched("x") == "HELLO X"

    assert engine.apply(patch) == record  # apply twice == apply once
    assert target.greet is patched and user_a.greet is patched and user_b.say is patched

    engine.revert(patch)
    assert target.greet is original and user_a.greet is original and user_b.say is original
    assert engine.record(patch.id) is None

    engine.apply(patch)
    again = target.greet
    assert again is not original and again("y") == "HELLO Y"
    assert user_a.greet is again and user_b.say is again
    engine.revert(patch)
    assert target.greet is original


def test_replace_and_add_kinds(fake_pkg):
    target = importlib.import_module("vnpu_fake.target")
    engine = PatchEngine("cpu", allow_mismatch=False)
    replace = make_patch(id="greet-replaced", kind="replace", build=lambda _original: lambda name: "bye " + name)
    engine.apply(replace)
    assert target.greet("z") == "bye z"
    add = make_patch(
        id="greeter-wave",
        target="vnpu_fake.target:Greeter.wave",
        kind="add",
        source_sha256=source_fingerprint(target.Greeter),
        build=lambda _original: lambda self: "wave",
    )
    assert engine.apply(add).status == APPLIED
    assert target.Greeter().wave() == "wave"
    engine.revert(add)
    assert not hasattr(target.Greeter, "wave")
    engine.revert(replace)
    assert target.greet("z") == "hello z"


def test_a_second_different_patch_of_the_same_target_is_refused(fake_pkg):
    engine = PatchEngine("cpu", allow_mismatch=False)
    engine.apply(make_patch())
    with pytest.raises(PatchConflictError, match="already patched by greet-louder"):
        engine.apply(make_patch(id="greet-other"))
    other_engine = PatchEngine("cpu", allow_mismatch=False)
    with pytest.raises(PatchConflictError, match="already carries patch greet-louder"):
        other_engine.apply(make_patch(id="greet-third"))


def test_drifted_target_fails_with_expected_and_found(fake_pkg):
    target = importlib.import_module("vnpu_fake.target")
    stale = "0" * 64
    engine = PatchEngine("cpu", allow_mismatch=False)
    with pytest.raises(PatchDriftError) as info:
        engine.apply(make_patch(source_sha256=stale))
    found = source_fingerprint(target.greet)
    assert f"expected sha256 {stale[:16]}..., found {found[:16]}..." in str(info.value)
    assert "VERL_NPU_ALLOW_MISMATCH=1" in str(info.value)
    assert target.greet("a") == "hello a", "a refused patch must leave the target untouched"


def test_version_mismatch_fails_with_expected_and_found(fake_pkg):
    engine = PatchEngine("cpu", allow_mismatch=False)
    with pytest.raises(PatchVersionError, match=r"expects pytest==0\.0\.1, found \d+\.\d+"):
        engine.apply(make_patch(requires={"pytest": "==0.0.1"}))
    with pytest.raises(PatchVersionError, match="expects no-such-dist>=1, found not installed"):
        engine.apply(make_patch(requires={"no-such-dist": ">=1"}))


def test_escape_hatch_turns_drift_and_version_mismatch_into_warnings(fake_pkg, capsys):
    target = importlib.import_module("vnpu_fake.target")
    engine = PatchEngine("cpu", allow_mismatch=True)
    with pytest.warns(PatchMismatchWarning) as caught:
        record = engine.apply(make_patch(source_sha256="0" * 64, requires={"pytest": "==0.0.1"}))
    messages = " ".join(str(w.message) for w in caught)
    assert "expects pytest==0.0.1" in messages and "expected sha256 0000000000000000" in messages
    assert record.status == APPLIED_WITH_WARNING
    assert target.greet("b") == "HELLO B"
    assert "[verl-npu] WARNING" in capsys.readouterr().err  # loud on every rank, not only in logs


def test_add_over_an_existing_attribute_and_replace_of_a_missing_one_are_drift(fake_pkg):
    target = importlib.import_module("vnpu_fake.target")
    engine = PatchEngine("cpu", allow_mismatch=False)
    with pytest.raises(PatchDriftError, match="expected 'greet' to be absent from Greeter, found it defined upstream"):
        engine.apply(
            make_patch(
                id="greeter-greet", target="vnpu_fake.target:Greeter.greet", kind="add",
                source_sha256=source_fingerprint(target.Greeter),
            )
        )  # fmt: skip
    with pytest.raises(
        PatchDriftError, match=re.escape("expected vnpu_fake.target:farewell to exist, found it missing")
    ):
        engine.apply(make_patch(id="farewell", target="vnpu_fake.target:farewell"))


def test_platform_and_condition_skip_with_a_reason(fake_pkg):
    target = importlib.import_module("vnpu_fake.target")
    engine = PatchEngine("cpu", allow_mismatch=False)
    record = engine.apply(make_patch(platforms=frozenset({"ascend"})))
    assert record.status == SKIPPED and record.detail == "platform cpu not in ['ascend']"
    record = engine.apply(make_patch(id="greet-conditional", condition=lambda: "feature present"))
    assert record.status == SKIPPED and record.detail == "feature present"
    assert target.greet("c") == "hello c"


def test_scheduled_patch_waits_for_the_first_import(fake_pkg):
    engine = PatchEngine("cpu", allow_mismatch=False)
    source = "def late():\n    return 'late'"
    patch = make_patch(
        id="late-patch",
        target="vnpu_fake.later:late",
        source_sha256=hashlib.sha256(source.encode()).hexdigest(),
        build=lambda original: lambda: original() + "!",
    )
    assert "vnpu_fake.later" not in sys.modules
    assert engine.schedule(patch).status == PENDING
    assert "vnpu_fake.later" not in sys.modules, "scheduling must not import the target"
    later = importlib.import_module("vnpu_fake.later")
    assert later.late() == "late!"
    assert engine.record("late-patch").status == APPLIED
    engine.revert(patch)
    assert later.late() == "late"


def test_revert_of_a_pending_patch_cancels_its_hook(fake_pkg):
    engine = PatchEngine("cpu", allow_mismatch=False)
    patch = make_patch(id="never", target="vnpu_fake.later:late", build=lambda original: lambda: "patched")
    engine.schedule(patch)
    engine.revert(patch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module("vnpu_fake.later").late() == "late"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("id", "Bad Id", "must be lowercase words"),
        ("target", "vnpu_fake.target.greet", "must look like 'pkg.module:Attr.path'"),
        ("kind", "monkey", "kind 'monkey' is not one of replace, wrap, add"),
        ("platforms", frozenset({"tpu"}), "must be a subset of"),
        ("source_sha256", "abc", "source_sha256 must be 64 hex"),
        ("remove_when", " ", "remove_when must be stated"),
    ],
)
def test_malformed_patch_declarations_are_rejected(fake_pkg, field, value, message):
    with pytest.raises(PatchSpecError, match=message):
        make_patch(**{field: value})


def test_a_patch_that_upstream_code_assigned_over_is_reported_displaced(fake_pkg):
    """MindSpeed's repatch assigns some DSA methods directly: the record still says applied, displaced() tells."""
    target = importlib.import_module("vnpu_fake.target")
    engine = PatchEngine("cpu", allow_mismatch=False)
    patch = make_patch()
    engine.apply(patch)
    assert engine.displaced() == []
    target.greet = lambda name: "assigned " + name  # what upstream code does after our patch
    assert engine.displaced() == ["greet-louder"]
    assert engine.record(patch.id).status == APPLIED
    engine.revert(patch)
