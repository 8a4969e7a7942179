"""``python -m verl_npu.layer_probe [--ray] [--timeout S]``: is the runtime layer active in a fresh process
(and in a Ray worker started from it)? Used by ``verl-npu doctor``.

It prints one JSON object per part as soon as that part is done: ``{"process": ...}`` after
``import verl``, then ``{"ray_worker": ...}``. A caller that has to kill a hung probe still knows
which part finished. The Ray part never raises: a Ray that cannot start a local node, or a worker
that does not report within the time left of ``--timeout``, is a ``{"ray_worker": {"failed": ...}}``
record naming the stage, the error, the seconds it took and Ray's start wait in effect, so doctor
names the cause instead of calling it an ``import verl`` failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

LAYER = "verl_npu.megatron_adaptor"
# Ray's wait for its GCS to publish its port when it starts a local node (Ray reads it as an integer)
RAY_START_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"
DEFAULT_TIMEOUT_S = 570.0  # run by hand without --timeout: doctor's default limit less its kill margin
SHUTDOWN_RESERVE_S = 10.0  # of the time left, kept for ray.shutdown() after a worker that did not report


def _in_this_process() -> dict:
    import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES the way a training process does)

    result = {"external_modules": os.environ.get("VERL_USE_EXTERNAL_MODULES"), "active": LAYER in sys.modules}
    if result["active"]:
        from verl_npu.megatron_adaptor import LAYER as loaded

        result.update(platform=loaded.platform, patches={r.id: r.status for r in loaded.records()})
    return result


def _failed(stage: str, exc: BaseException | None, started: float, **extra) -> dict:
    error = f"{type(exc).__name__}: {exc}" if exc is not None else None
    elapsed = round(time.monotonic() - started, 1)
    return {"failed": stage, "error": error, "elapsed_s": elapsed, **extra}


def _in_a_ray_worker(deadline: float) -> dict:
    started = time.monotonic()
    start_wait = os.environ.get(RAY_START_WAIT_VARIABLE)
    try:
        import ray
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

        runtime_env = get_ppo_ray_runtime_env()
    except Exception as exc:
        return _failed("setup", exc, started)
    started = time.monotonic()
    try:
        # a private instance: on a node where `ray start` already runs, ray.init() would join that cluster
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    except Exception as exc:
        with_wait = {"start_wait_variable": RAY_START_WAIT_VARIABLE, "start_wait_s": start_wait}
        with contextlib.suppress(Exception):  # whatever it started before giving up
            ray.shutdown()
        return _failed("start", exc, started, **with_wait)
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

        waited = time.monotonic()
        wait_s = max(0.0, deadline - waited - SHUTDOWN_RESERVE_S)
        try:
            return ray.get(probe.remote(), timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            return _failed("worker-timeout", None, waited, wait_s=round(wait_s, 1))
        except Exception as exc:  # the task raised, its runtime env could not be set up, the worker died
            return _failed("worker", exc, waited)
    finally:
        ray.shutdown()


def _timeout(argv: list[str]) -> float:
    if "--timeout" not in argv:
        return DEFAULT_TIMEOUT_S
    given = (argv[argv.index("--timeout") + 1 :] or ["nothing"])[0]
    from verl_npu import inputs

    try:
        return inputs.number("--timeout", given, above=0)  # ASCII digits only, as every numeric option
    except inputs.InputError as exc:
        raise ValueError(f"verl_npu.layer_probe: {exc} (seconds)") from None


def main(argv: list[str]) -> int:
    try:
        deadline = time.monotonic() + _timeout(argv)
    except ValueError as exc:  # bad input: exit 2, as docs/errors.md has it
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps({"process": _in_this_process()}), flush=True)
    if "--ray" in argv:
        print(json.dumps({"ray_worker": _in_a_ray_worker(deadline)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
