"""The ordered install plan that install.sh executes, one step per line. Standard library only."""

from __future__ import annotations

import dataclasses

from verl_npu.stack.manifest import NPU_TARGETS, REPO_ROOT, TARGETS, Package, Stack, StackError


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # python | chip | pip | git | replace | local | contracts | build-manifest
    name: str
    fields: dict[str, str]

    def line(self) -> str:
        for value in (self.kind, self.name, *self.fields.keys(), *self.fields.values()):
            if "|" in value or "\n" in value:
                raise StackError(f"plan value {value!r} contains a separator")
        return "|".join([self.kind, self.name, *(f"{k}={v}" for k, v in self.fields.items())])


def _check_patches_exist(stack: Stack, target: str) -> None:
    tables = [(f"packages.{p.name}", p.patches) for p in stack.packages_for(target)]
    tables += [(f"git.{g.name}", g.patches) for g in stack.git_for(target)]
    for table, patches in tables:
        for patch in patches:
            if not (REPO_ROOT / patch).is_file():
                raise StackError(
                    f"{stack.path}: [{table}] key 'patches' names {patch!r}, which does not exist in {REPO_ROOT}"
                )


def _index_fields(pkg: Package, target: str) -> dict[str, str]:
    fields = {"requirement": pkg.requirement}
    if pkg.index:
        fields["index"] = pkg.index
    if pkg.index_x86_64 and target in NPU_TARGETS:
        fields["index_x86_64"] = pkg.index_x86_64
    return fields


def _pip_step(pkg: Package, target: str) -> Step:
    fields = _index_fields(pkg, target)
    if pkg.patches:
        fields["patches"] = ",".join(pkg.patches)
    return Step("pip", pkg.name, fields)


def _git_step(comp) -> Step:
    fields = {"url": comp.url, "ref": comp.ref, "commit": comp.commit, "install": comp.install}
    if comp.version:
        fields["version"] = comp.version
    if comp.patches:
        fields["patches"] = ",".join(comp.patches)
    if not comp.build_isolation:
        fields["build_isolation"] = "false"
        fields["build_requires_skip"] = ",".join(comp.build_requires_skip)
    return Step("git", comp.name, fields)


def install_plan(stack: Stack, target: str, *, dev_tools: bool = False) -> list[Step]:
    """The ordered install steps for ``target``; install.sh executes them one by one."""
    if target not in TARGETS:
        raise StackError(f"unknown target {target!r}; valid targets: {', '.join(TARGETS)}")
    _check_patches_exist(stack, target)
    steps = [Step("python", f"python{stack.python}", {"version": stack.python})]
    if target in NPU_TARGETS:
        chip = stack.chips[target]
        fields = {"soc_version": chip.soc_version, "cann_version": chip.cann_version, "base_image": chip.base_image}
        steps.append(Step("chip", target, fields))
    pkgs = {p.name: p for p in stack.packages_for(target)}
    replacing = [p for p in pkgs.values() if p.replaces]

    def pip_steps(names) -> list[Step]:
        return [_pip_step(pkgs.pop(name), target) for name in names if name in pkgs]

    # The accelerator runtime first: everything after it is constrained to the same torch, and
    # torch's companions (pinned by vllm-ascend) come from the same index right after it.
    steps += pip_steps(("torch", "torchvision", "torchaudio", "torch-npu", "triton-ascend"))
    steps += [_git_step(comp) for comp in stack.git_for(target)]
    steps += pip_steps(("megatron-core", "transformers", "mbridge", "verl"))
    steps += pip_steps(sorted(pkgs))  # anything added to the manifest later still gets installed
    # After every third-party install (vllm's requirements bring upstream triton on x86_64): remove
    # the distributions that share a package's import directory and reinstall the package over them.
    steps += [Step("replace", p.name, {**_index_fields(p, target), "remove": ",".join(p.replaces)}) for p in replacing]
    # The images run the npu test tier in themselves (nightly.yml): they get the test extra (pytest, hypothesis).
    extras = "dev" if dev_tools else "test" if target in NPU_TARGETS else ""
    steps.append(Step("local", "verl-npu", {"extras": extras}))
    if target in NPU_TARGETS:
        # the facts verl-npu relies on in MindSpeed, vllm-ascend and torch-npu, against what was just
        # installed: a drifted upstream fails the image build, not a job (docs/ascend_contracts.md)
        steps.append(Step("contracts", "upstream-contracts", {}))
    steps.append(Step("build-manifest", "build-manifest.json", {}))
    return steps
