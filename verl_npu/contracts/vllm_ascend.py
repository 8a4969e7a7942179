"""What verl-npu relies on in vllm-ascend at the commit pinned in verl_npu/stack/stack.toml."""

from __future__ import annotations

from verl_npu.contracts.spec import Contract, Expect

ALLOC_CONF_VARIABLE = "PYTORCH_NPU_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"

CONTRACTS = (
    Contract(
        id="vllm-ascend-requirements",
        component="vllm-ascend",
        path="requirements.txt",
        locator="file",
        symbol=None,
        line=1,
        sha256="0f6af90238084fed48486387cd10d03ef80677eede58a68a8a1ca95f279341bb",
        relied_on="vllm-ascend's requirements pin transformers==5.5.4 and arctic-inference==0.1.1 (removed by "
        "patches/vllm-ascend/0001-*, the stack pins transformers) and torchvision==0.25.0 / torchaudio==2.10.0 (the "
        "stack pins the same versions, from the CPU index on x86_64)",
        used_by="patches/vllm-ascend/, verl_npu/stack/stack.toml, tests_npu/test_resolution.py",
        expects=(
            Expect("transformers==5.5.4", "the transformers pin our patch removes"),
            Expect("arctic-inference==0.1.1", "the plugin our patch removes"),
            Expect("torchvision==0.25.0", "the stack's torchvision pin"),
            Expect("torchaudio==2.10.0", "the stack's torchaudio pin"),
            Expect("torch-npu==2.10.0.post4", "the stack's torch-npu pin"),
        ),
    ),
    Contract(
        id="vllm-ascend-sleep-mode-refuses-expandable-segments",
        component="vllm-ascend",
        path="vllm_ascend/device_allocator/camem.py",
        locator="python",
        symbol="CaMemAllocator.__init__",
        line=151,
        sha256="e54b7f0af2e76b7d389e8991c32363de47dec20d03cc3dfd852975f10f39726e",
        relied_on=f"vLLM's sleep mode (CaMemAllocator, verl's default enable_sleep_mode=True) asserts that "
        f"{ALLOC_CONF_VARIABLE} does not contain {EXPANDABLE_SEGMENTS}",
        used_by="docker/Dockerfile.*, verl_npu/runtime_patches/ray_runtime_env.py, ci/nightly/nightly.env (never set "
        "it); verl_npu/doctor.py and verl_npu/preflight (flag it)",
        expects=(
            Expect(f'os.environ.get("{ALLOC_CONF_VARIABLE}", "")', "reads the allocator configuration"),
            Expect(f'assert "{EXPANDABLE_SEGMENTS}" not in conf', "refuses expandable segments"),
        ),
    ),
    Contract(
        id="vllm-ascend-expandable-segments-only-without-sleep-mode",
        component="vllm-ascend",
        path="vllm_ascend/platform.py",
        locator="python",
        symbol="NPUPlatform.check_and_update_config",
        line=450,
        sha256="6a9f20cd1f4281bfe7b578089df2d61cc3fa2a165e80ef2a0eb0b868ffd83464",
        relied_on=f"vllm-ascend turns {EXPANDABLE_SEGMENTS} on by itself only when sleep mode is off, and says not "
        "to set it for RL (sleep mode)",
        used_by="verl_npu/doctor.py and verl_npu/preflight (the fix they suggest: leave it unset)",
        expects=(
            Expect("if model_config and not model_config.enable_sleep_mode:", "only without sleep mode"),
            Expect("We should not set this environment variable in RL (sleep mode) scenarios.", "the upstream advice"),
        ),
    ),
)
