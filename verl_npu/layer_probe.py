"""``python -m verl_npu.layer_probe [--ray]``: is the runtime layer active in a fresh process
(and in a Ray worker started from it)? Prints one JSON object; used by ``verl-npu doctor``.
"""

from __future__ import annotations

import json
import os
import sys

LAYER = "verl_npu.megatron_adaptor"


def _in_this_process() -> dict:
    import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES the way a training process does)

    result = {"external_modules": os.environ.get("VERL_USE_EXTERNAL_MODULES"), "active": LAYER in sys.modules}
    if result["active"]:
        from verl_npu.megatron_adaptor import LAYER as loaded

        result.update(platform=loaded.platform, patches={r.id: r.status for r in loaded.records()})
    return result


def _in_a_ray_worker() -> dict:
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    runtime_env = get_ppo_ray_runtime_env()
    # a private instance: on a node where `ray start` already runs, ray.init() would join that cluster
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    try:

        @ray.remote(num_cpus=1)
        def probe() -> dict:
            import verl  # noqa: F401

            env_vars = ray.get_runtime_context().runtime_env.get("env_vars", {})
            seen = {
                "active": LAYER in sys.modules,
                "forwarded": env_vars.get("VERL_USE_EXTERNAL_MODULES"),
                "forwarded_variables": sorted(env_vars),
            }
            if seen["active"]:
                from verl_npu.megatron_adaptor import LAYER as loaded

                seen.update(platform=loaded.platform, patches={r.id: r.status for r in loaded.records()})
            return seen

        return ray.get(probe.remote(), timeout=300)
    finally:
        ray.shutdown()


def main(argv: list[str]) -> int:
    report = {"process": _in_this_process()}
    if "--ray" in argv:
        report["ray_worker"] = _in_a_ray_worker()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
