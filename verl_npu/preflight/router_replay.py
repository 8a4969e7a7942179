"""MoE routing replay (R2 / R3) against the rollout that has to supply R3's routes, from the composed launch.

verl 0.9.1 replays routes in its Megatron engine when ``actor_rollout_ref.actor.megatron.router_replay.mode`` is R2
(routes recorded in the old-log-prob pass) or R3 (routes the rollout took, which the rollout returns only when
``actor_rollout_ref.rollout.enable_rollout_routing_replay`` is on). Nothing in verl checks the two keys against each
other before the first training step, nor the rollout against what R3 needs; this module does, and reports every
problem of one launch at once. docs/preflight_rollout.md ("Routing replay") gives each rule with the verl, vLLM and
vllm-ascend code it follows, and what tests_npu/preflight/test_preflight_router_replay.py executes on the CPU to
establish it.

Reads the resolved config itself (the typed launch view has no replay keys) through the same Reader, so a bad value
is a FAIL naming its key and what is allowed, and no rule is judged on a value that was not read.

The vLLM and vllm-ascend facts the verdicts rest on are recorded contracts (:data:`CONTRACTS`, listed in
docs/ascend_contracts.md), verified against the pinned sources by the network-tier tests, at every image build and
by ``verl-npu doctor``; verl's side (its server asking for the routes) is checked against the installed verl by
tests_npu/contracts/test_contracts.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.inputs import MAX_PARALLEL
from verl_npu.preflight import unknowns
from verl_npu.preflight.values import ARR, ROLE_SECTIONS, ROLLOUT, Reader

MODES = ("disabled", "R2", "R3")  # verl's EngineRouterReplayConfig accepts these, exactly
ROLLOUT_ROUTES = f"{ROLLOUT}.enable_rollout_routing_replay"
ROLLOUT_NAME = f"{ROLLOUT}.name"
# the rollout servers of verl 0.9.1 that ask their engine for the routes (vLLM's and SGLang's); verl-npu ships vLLM
ROUTE_RETURNING_ROLLOUTS = ("vllm", "sglang")
# what vLLM reads from the model's config to size its capture buffer; without them it raises at engine start
# (contract vllm-routes-capturer-config-keys)
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "top_k_experts")

VLLM_SERVER = "verl/workers/rollout/vllm_rollout/vllm_async_server.py"
MEGATRON_ENGINE = "verl/workers/engine/megatron/transformer_impl.py"
ENGINE_WORKERS = "verl/workers/engine_workers.py"
ASCEND_RUNNER = "vllm_ascend/worker/model_runner_v1.py"
ASCEND_MOE = "vllm_ascend/ops/fused_moe/fused_moe.py"
ASCEND_CAPTURE = "vllm_ascend/patch/worker/patch_routed_experts_capture.py"
ASCEND_SPLIT = "vllm_ascend/ops/fused_moe/prepare_finalize.py"
# the contracts (verl_npu/contracts) each Ascend verdict of _rollout_returns_routes / _ascend_checks rests on
CONTRACTS = (
    "vllm-routes-capturer-config-keys",  # EXPERT_COUNT_KEYS, EXPERTS_PER_TOKEN_KEYS
    "vllm-routes-capturer-buffer",  # [tokens, num_hidden_layers, top-k], dense layers' columns left 0
    "vllm-fused-moe-layer-id-is-its-decoder-layer",
    "vllm-routes-capture-by-absolute-layer",  # vLLM's capture: no gather without DP, raises on a short slice
    "vllm-runner-binds-the-routes-capturer-it-makes",
    "vllm-routes-per-request-prompt-then-forwarded-tokens",  # prompt + response - 1 rows
    "vllm-routes-joined-when-the-request-finishes",
    "vllm-routes-refused-with-pipeline-parallelism-or-a-kv-connector",  # disaggregation
    "vllm-dp-metadata-only-with-data-parallelism",  # DP 1: nothing gathered
    "vllm-ascend-runner-makes-the-routes-capturer-with-the-kv-cache",
    "vllm-ascend-runner-binds-the-routes-capturer-to-every-fused-moe",
    "vllm-ascend-unquantized-moe-captures-the-routes-it-dispatches",
    "vllm-ascend-quantized-moe-methods-never-capture",  # a quantized rollout: FAIL
    "vllm-ascend-ep-moe-communication",  # which layouts split a step over TP
    "vllm-ascend-all2all-moe-routes-a-tp-slice",
    "vllm-ascend-mc2-moe-routes-a-tp-slice",
    "vllm-ascend-routes-capture-gathers-tp-slices",  # vllm-ascend's capture, what verl's GLM-5.2 patch brings
    "vllm-ascend-routed-experts-capture-patch",
    "vllm-ascend-routes-capture-patch-only-for-vllm-main",
)


def mode_key(role: str) -> str:
    """The dotted key of a Megatron role's replay mode (actor, ref or critic)."""
    return f"{ROLE_SECTIONS[role]}.megatron.router_replay.mode"


def _text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config, as vLLM's capturer reads it (a multimodal config nests it)."""
    text = hf.get("text_config")
    return text if isinstance(text, Mapping) else hf


def _has_routed_experts(hf: Mapping[str, Any]) -> bool:
    text = _text_config(hf)
    return any(text.get(k) for k in EXPERT_COUNT_KEYS) and any(text.get(k) for k in EXPERTS_PER_TOKEN_KEYS)


def router_replay_checks(
    config: Mapping[str, Any], hf: Mapping[str, Any], env: Mapping[str, str], platform: str = "ascend"
) -> list[Check]:
    """Every replay problem of the launch (nothing when replay is off everywhere and the rollout returns no routes).

    ``config``: the resolved verl config; ``hf``: the model's HF config; ``env``: the trainer's environment (the
    launch's exports and --env), which verl-npu forwards to the rollout's workers; ``platform``: what the rollout
    runs on (``ascend``: vLLM with vllm-ascend).
    """
    r = Reader(config)
    modes = {role: r.choice(mode_key(role), MODES, default="disabled") for role in ("actor", "ref", "critic")}
    returns_routes = r.boolean(ROLLOUT_ROUTES, default=False)
    name = r.text(ROLLOUT_NAME, default=None, max_length=64)
    pad_to_length = r.boolean(f"{ARR}.actor.megatron.pad_to_length", default=False)
    remove_padding = r.boolean(f"{ARR}.actor.megatron.use_remove_padding", default=True)
    if r.errors:
        return [Check("router-replay.value", FAIL, str(e), fix=_value_fix(e)) for e in r.errors]
    actor = modes["actor"]
    checks = _ignored_roles(modes)
    if actor == "disabled" and not returns_routes:
        return checks
    checks += _pairing(actor, returns_routes, name)
    if actor == "disabled":
        if not _has_routed_experts(hf):
            checks.append(
                Check(
                    "router-replay.model",
                    FAIL,
                    f"{ROLLOUT_ROUTES}=True on a model without routed experts (its config has none of "
                    f"{', '.join(EXPERT_COUNT_KEYS)} with {' / '.join(EXPERTS_PER_TOKEN_KEYS)}): vLLM's route "
                    "capturer raises at engine start",
                    fix=f"set {ROLLOUT_ROUTES}=False: routing replay is for MoE models",
                )
            )
        return checks
    if not _has_routed_experts(hf):
        checks.append(
            Check(
                "router-replay.model",
                FAIL,
                f"{mode_key('actor')}={actor} on a model without routed experts (its config has none of "
                f"{', '.join(EXPERT_COUNT_KEYS)} with {' / '.join(EXPERTS_PER_TOKEN_KEYS)}): verl's replay finds no "
                "router to drive (verl/utils/megatron/router_replay_utils.py, set_router_replay_data; R2's record "
                f"raises 'completed without capturing any router routes', {MEGATRON_ENGINE})"
                + (", and vLLM's route capturer raises at engine start" if returns_routes else ""),
                fix=f"set {mode_key('actor')}=disabled and {ROLLOUT_ROUTES}=False: routing replay is for MoE models",
            )
        )
    if pad_to_length and remove_padding:
        checks.append(
            Check(
                "router-replay.padding",
                FAIL,
                f"{mode_key('actor')}={actor} with {ARR}.actor.megatron.pad_to_length=True (and use_remove_padding="
                f"True): verl's Megatron engine raises 'pad_to_length is not supported with router replay' at the "
                f"first forward ({MEGATRON_ENGINE}, forward_step)",
                fix=f"set {ARR}.actor.megatron.pad_to_length=False",
            )
        )
    if actor == "R3" and returns_routes:
        checks += _rollout_returns_routes(r, name, hf, env, platform)
    return checks


def _value_fix(error: Exception) -> str:
    key = getattr(error, "key", "")
    if key.endswith(".router_replay.mode"):
        return f"set {key} to one of {', '.join(MODES)} (verl compares the text exactly)"
    if key == ROLLOUT_NAME:
        return f"set {key} to the rollout's name (vllm on the verl-npu stack)"
    return f"set {key} to True or False" if key else ""


def _ignored_roles(modes: Mapping[str, str]) -> list[Check]:
    """A replay mode on the reference model or the critic: verl decides replay from the actor's mode alone."""
    checks = []
    for role in ("ref", "critic"):
        if modes[role] == "disabled":
            continue
        why = (
            "the reference log-prob pass runs with replay off (compute_ref_log_prob)"
            if role == "ref"
            else "no critic call turns replay on"
        )
        checks.append(
            Check(
                "router-replay.ignored",
                WARN,
                f"{mode_key(role)}={modes[role]}: verl 0.9.1 ignores it. It turns replay on or off from "
                f"{mode_key('actor')} only ({ENGINE_WORKERS}, ActorRolloutRefWorker), and {why}; the {role}'s engine "
                "only builds replay hooks into its routers that nothing drives",
                fix=f"drop {mode_key(role)} (set routing replay on {mode_key('actor')})",
            )
        )
    return checks


def _pairing(actor: str, returns_routes: bool, name: str | None) -> list[Check]:
    """The actor's replay mode against the rollout's route switch."""
    mode = f"{mode_key('actor')}={actor}"
    routes = f"{ROLLOUT_ROUTES}={returns_routes}"
    if actor == "R3" and not returns_routes:
        return [
            Check(
                "router-replay.rollout-routes",
                FAIL,
                f"{mode} with {routes}: R3 replays the routes the rollout took, and the rollout returns none unless "
                f"asked, so verl's Megatron engine raises 'router_replay REPLAY: micro_batch has no routed_experts' at "
                f"the first actor forward that replays (the old-log-prob pass, or the update in bypass mode; "
                f"{MEGATRON_ENGINE}, forward_step)",
                fix=f"add {ROLLOUT_ROUTES}=True (or set {mode_key('actor')}=R2 to replay the routes the old-log-prob "
                "pass records)",
            )
        ]
    if actor == "R2" and returns_routes:
        return [
            Check(
                "router-replay.rollout-routes",
                FAIL,
                f"{mode} with {routes}: the rollout's routes reach the batch, and verl's Megatron engine records R2 "
                f"routes only when the batch carries none ({MEGATRON_ENGINE}, forward_backward_batch), so both the "
                "old-log-prob pass and the update replay the rollout's routes without R3's alignment of the final "
                "token: neither R2 nor R3. verl 0.9.1's trainer (verl.trainer.main_ppo, the v1 trainer) does not "
                "check the pair; only the legacy trainer's check (verl/trainer/ppo/ray_trainer.py, 'conflicting "
                "router replay configuration') names it, and it never fires for the Megatron engine",
                fix=f"for R2 set {ROLLOUT_ROUTES}=False; for the rollout's routes set {mode_key('actor')}=R3",
            )
        ]
    if actor == "disabled" and returns_routes:
        where = "vLLM keeps every cached token's routes in host memory and " if name == "vllm" else ""
        return [
            Check(
                "router-replay.rollout-routes",
                WARN,
                f"{routes} with {mode}: the rollout computes and returns every token's routes ({where}verl stores them "
                "with each sample as [tokens, layers, top-k] int16), and no actor pass reads them",
                fix=f"drop {ROLLOUT_ROUTES}, or set {mode_key('actor')}=R3 to replay them",
            )
        ]
    return [Check("router-replay.rollout-routes", OK, f"{mode} with {routes}")]


def _patch_on(env: Mapping[str, str]) -> tuple[bool | None, str]:
    """Whether verl's GLM-5.2 patch is on in the rollout's workers (None: only the running launch knows), and the
    value as the message shows it."""
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE

    raw = env.get(GLM52_PATCH_VARIABLE)
    if raw is None:
        return False, f"{GLM52_PATCH_VARIABLE} is not set"
    if unknowns.contains(raw):
        return None, f"{GLM52_PATCH_VARIABLE}={raw}"
    return raw.strip().lower() in GLM52_PATCH_ON_VALUES, f"{GLM52_PATCH_VARIABLE}={raw}"  # verl's own test


def _rollout_returns_routes(
    r: Reader, name: str | None, hf: Mapping[str, Any], env: Mapping[str, str], platform: str
) -> list[Check]:
    """Whether the rollout hands R3 the routes it took, for this backend, platform and parallel layout
    (disaggregation: contract vllm-routes-refused-with-pipeline-parallelism-or-a-kv-connector)."""
    check = "router-replay.rollout"
    if name not in ROUTE_RETURNING_ROLLOUTS:
        return [
            Check(
                check,
                FAIL,
                f"{mode_key('actor')}=R3 with {ROLLOUT_NAME}={name}: verl 0.9.1 asks only its vLLM and SGLang servers "
                f"for the routes ({VLLM_SERVER}, verl/workers/rollout/sglang_rollout/async_sglang_server.py); this "
                "rollout returns none, and the first replaying forward raises",
                fix=f"set {ROLLOUT_NAME}=vllm (the verl-npu stack's rollout)",
            )
        ]
    if name == "sglang":
        return [
            Check(
                check,
                WARN,
                f"{mode_key('actor')}=R3 with {ROLLOUT_NAME}=sglang: verl asks SGLang for the routes, but the "
                "verl-npu stack pins no SGLang and preflight checks vLLM's route capture only: not checked",
            )
        ]
    if r.boolean(f"{ROLLOUT}.disaggregation.enabled", default=False):
        return [
            Check(
                check,
                FAIL,
                f"{mode_key('actor')}=R3 with {ROLLOUT}.disaggregation.enabled=True: verl hands vLLM a KV connector "
                "for prefill/decode disaggregation, and vLLM 0.23.0 refuses it together with "
                "enable_return_routed_experts at engine start (vllm/config/vllm.py: routes captured on the prefill "
                "side never reach the decode side)",
                fix=f"set {ROLLOUT}.disaggregation.enabled=False for R3",
            )
        ]
    if platform != "ascend":
        return [
            Check(
                check,
                OK,
                f"R3 with vLLM: verl starts it with enable_return_routed_experts ({VLLM_SERVER}), and vLLM's GPU model "
                "runner binds its route capturer to every FusedMoE router (vllm/v1/worker/gpu_model_runner.py)",
            )
        ]
    return _ascend_checks(r, hf, env)


def _ascend_checks(r: Reader, hf: Mapping[str, Any], env: Mapping[str, str]) -> list[Check]:
    """vLLM with vllm-ascend 0.23.0: which MoE code records the routes, and whether the token layout it sees is
    the one the capturer assumes (each rule's facts: the vllm-ascend contracts of :data:`CONTRACTS`)."""
    check = "router-replay.rollout"
    sizes = Reader(r.root)
    quantization = sizes.text(f"{ROLLOUT}.quantization", default=None, max_length=64)
    tp = sizes.integer(f"{ROLLOUT}.tensor_model_parallel_size", 1, MAX_PARALLEL, default=1)
    dp = sizes.integer(f"{ROLLOUT}.data_parallel_size", 1, MAX_PARALLEL, default=1)
    ep = sizes.integer(f"{ROLLOUT}.expert_parallel_size", 1, MAX_PARALLEL, default=1)
    if sizes.errors:
        return [
            Check(
                check,
                WARN,
                "R3's route capture on Ascend was not checked: the rollout's quantization or parallel sizes are not "
                "readable (reported above)",
            )
        ]
    model_quant = _text_config(hf).get("quantization_config") or hf.get("quantization_config")
    checks = []
    if quantization is not None or model_quant:
        what = f"{ROLLOUT}.quantization={quantization}" if quantization is not None else "a quantized checkpoint"
        checks.append(
            Check(
                check,
                FAIL,
                f"{mode_key('actor')}=R3 with {what}: on vllm-ascend 0.23.0 only the unquantized MoE method records "
                f"routes ({ASCEND_MOE}, AscendUnquantizedFusedMoEMethod.apply); the quantized ones "
                "(vllm_ascend/quantization/methods/) select experts without calling the capturer, so every route "
                "comes back as expert 0 and R3 replays that",
                fix="roll out the BF16 checkpoint unquantized for R3 (or set the replay mode to R2)",
            )
        )
    # vllm-ascend's MC2 and all-to-all MoE (expert parallel across more than one device) give each TP rank its
    # slice of the step's tokens before routing; only DP > 1 tells the capturer to gather them back
    split = ep > 1 and tp > 1
    patch, shown = _patch_on(env)
    if split and dp == 1:
        checks.append(
            Check(
                check,
                FAIL,
                f"{mode_key('actor')}=R3 with rollout TP {tp}, DP 1 and EP {ep}: vllm-ascend's expert-parallel MoE "
                f"(MC2 or all-to-all) hands each TP rank only its slice of the step's tokens to route "
                f"({ASCEND_SPLIT}), and the route capturer gathers the slices only under data parallelism (vLLM "
                "makes DP metadata only for DP > 1): the routes returned cover the first 1/TP of each step's tokens "
                "and the rest come back as expert 0, which R3 replays",
                fix=f"run the rollout with {ROLLOUT}.data_parallel_size > 1 (EP = TP x DP), or with "
                f"{ROLLOUT}.expert_parallel_size=1",
            )
        )
    elif split and patch is None:
        checks.append(
            Check(
                check,
                FAIL,
                f"{shown}: only known when the launch runs, and R3's route capture with rollout TP {tp} x EP {ep} "
                "depends on it",
                fix="write its value literally in the launch's env file, or pass it with --env NAME=VALUE",
            )
        )
    elif split and not patch:
        checks.append(
            Check(
                check,
                FAIL,
                f"{mode_key('actor')}=R3 with rollout TP {tp}, DP {dp}, EP {ep} and {shown}: each TP rank routes its "
                f"slice of the step's tokens (MC2 / all-to-all, {ASCEND_SPLIT}), and vLLM 0.23.0's own capturer, the "
                "one in force, raises 'unexpected topk_ids batch dim' on a rank whose all-to-all slice is the shorter "
                f"one. vllm-ascend's capturer ({ASCEND_CAPTURE}) gathers uneven and MC2-padded slices, but vllm-ascend "
                "0.23.0 imports it only for vLLM main (vllm_ascend/patch/worker/__init__.py); on this stack verl's "
                "GLM-5.2 patch is what imports it (verl/utils/vllm/npu_vllm_patch.py)",
                fix="set VERL_VLLM_ASCEND_GLM52_PATCH=1 in the launch's env file",
            )
        )
    if not checks:
        capture = (
            f"vllm-ascend's capturer (TP slices gathered; imported by verl's GLM-5.2 patch, {shown})"
            if split
            else "vLLM's capturer"
        )
        checks.append(
            Check(
                check,
                OK,
                f"R3 with vLLM on Ascend (rollout TP {tp}, DP {dp}, EP {ep}): verl starts vLLM with "
                f"enable_return_routed_experts ({VLLM_SERVER}); vllm-ascend 0.23.0's NPU model runner hands the route "
                f"capturer to every FusedMoE layer ({ASCEND_RUNNER}, _bind_routed_experts_capturer) and its "
                f"unquantized MoE method records each layer's top-k as the experts receive it ({ASCEND_MOE}); "
                f"{capture}. Routes come back per sample as [prompt + response - 1, layers, top-k] (dense layers 0; "
                "verl pads the last token). Established on one rank on the CPU; the multi-rank gather runs on a node "
                "only",
            )
        )
    return checks
