"""Code that only the tests (tests_npu/) and the benchmarks (bench/) run: the declared place for it.

Nothing in the rest of verl_npu imports this package, and it is the only part of verl_npu allowed to
be imported by tests or benchmarks alone (tests_npu/repo/test_repo_habits.py checks both):

* :mod:`verl_npu.testing.glm5_model` builds the GLM-5-shaped test model from the bridge's config
  mapping with its deliberate differences as named overrides;
* :mod:`verl_npu.testing.leak_sentinel` measures device-memory growth per micro-batch;
* :mod:`verl_npu.testing.cpu_megatron` redirects megatron-core's CUDA calls to the CPU, so megatron
  runs in CI without an accelerator.
"""
