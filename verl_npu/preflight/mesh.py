"""Device-mesh checks for every role of a verl Megatron launch; each failure names the numbers involved.

verl only finds most of these at worker start-up (after the job has waited in the queue), and
megatron reports some as a bare assertion on one rank. The rules are megatron-core 0.18's
(parallel_state.initialize_model_parallel, the pipeline layer split, TransformerConfig's
sequence-parallel rule) and verl 0.9.1's (batch normalisation per data-parallel rank, vLLM's
expert-parallel size, the THD padding in verl.models.mcore.util). They read the launch's typed view
(:class:`verl_npu.preflight.values.LaunchValues`): every size is an integer in range before any arithmetic here.
A training role's sizes and their rules are its :class:`verl_npu.parallelism.Parallelism` record.
"""

from __future__ import annotations

from verl_npu.checks import FAIL, OK, WARN, Check, failed
from verl_npu.parallelism import DP, Parallelism
from verl_npu.preflight.values import LaunchValues, MegatronRole, RolloutValues


def check_train_mesh(role: str, mesh: Parallelism, num_layers: int, num_experts: int) -> list[Check]:
    """One role's mesh: every size megatron would refuse (:meth:`verl_npu.parallelism.Parallelism.problems`)."""
    problems = mesh.problems(num_layers, num_experts)
    if problems:
        return [Check(f"mesh.{role}-{p.check}", FAIL, f"{role}: {p.message}") for p in problems]
    return [
        Check(
            f"mesh.{role}-mesh",
            OK,
            f"{role}: TP {mesh.tp} x PP {mesh.pp} x CP {mesh.cp} x DP {mesh.dp} = {mesh.world}; EP {mesh.ep} x "
            f"ETP {mesh.etp} x expert-DP {mesh.expert_dp}; layers per stage {mesh.stage_layers(num_layers)}",
        )
    ]


def check_rollout(rollout: RolloutValues, world: int, num_experts: int) -> list[Check]:
    tp, dp, pp, ep = rollout.tp, rollout.dp, rollout.pp, rollout.ep
    checks = []
    replica = tp * dp * pp
    if world % replica:
        checks.append(
            Check(
                "mesh.rollout-replica",
                FAIL,
                f"rollout: world size {world} is not divisible by TP {tp} x DP {dp} x PP {pp} = {replica}",
            )
        )
    if ep > 1 and ep != tp * dp:
        checks.append(
            Check(
                "mesh.rollout-ep",
                FAIL,
                f"rollout: expert_parallel_size {ep} must equal TP {tp} x DP {dp} = {tp * dp} (vLLM's expert "
                "parallelism spans the tensor- and data-parallel ranks of a replica)",
            )
        )
    if ep > 1 and num_experts and num_experts % ep:
        checks.append(
            Check("mesh.rollout-ep", FAIL, f"rollout: EP {ep} does not divide the model's {num_experts} experts")
        )
    if not checks:
        replicas = world // replica
        checks.append(
            Check("mesh.rollout-mesh", OK, f"rollout: {replicas} replicas of TP {tp} x DP {dp} x PP {pp}, EP {ep}")
        )
    return checks


def check_thd_alignment(values: LaunchValues, role: MegatronRole) -> list[Check]:
    """verl pads each packed sequence to tp (tp*cp*2 with CP); the token budget must hold the padded max."""
    mesh, max_sequence = role.parallelism, values.max_sequence
    align = mesh.tp * mesh.cp * 2 if mesh.cp > 1 else mesh.tp
    padded = -(-max_sequence // align) * align
    layout = "THD" if role.use_remove_padding else "BSHD"
    if values.use_dynamic_bsz:
        budget = values.ppo_max_token_len_per_gpu or values.log_prob_max_token_len_per_gpu
        if budget is not None and budget < padded:
            return [
                Check(
                    f"mesh.{role.role}-thd-alignment",
                    FAIL,
                    f"{role.role}: a {max_sequence}-token sequence padded to a multiple of {align} "
                    f"({'tp*cp*2' if mesh.cp > 1 else 'tp'}) is {padded} tokens, more than the per-device token "
                    f"budget {budget}; raise ppo_max_token_len_per_gpu to >= {padded}",
                )
            ]
    return [
        Check(
            f"mesh.{role.role}-thd-alignment",
            OK,
            f"{role.role}: {layout} sequences padded to multiples of {align}; longest {max_sequence} -> {padded}",
        )
    ]


def check_batches(values: LaunchValues, mesh: Parallelism) -> list[Check]:
    """verl's per-rank batch split: train batch -> mini-batches -> per-DP-rank -> micro-batches."""
    n = values.rollout.n
    train, mini = values.train_batch_size, values.ppo_mini_batch_size
    checks = []
    if train % mini:
        checks.append(
            Check(
                "mesh.batch-mini",
                FAIL,
                f"data.train_batch_size {train} is not divisible by actor.ppo_mini_batch_size {mini}",
            )
        )
    splits = all(p.check != DP for p in mesh.problems())
    if splits and (mini * n) % mesh.dp:
        checks.append(
            Check(
                "mesh.batch-dp",
                FAIL,
                f"ppo_mini_batch_size {mini} x rollout.n {n} = {mini * n} samples per mini-batch do not split over "
                f"{mesh.dp} data-parallel ranks",
            )
        )
    elif not values.use_dynamic_bsz:
        micro = values.ppo_micro_batch_size_per_gpu
        per_rank = mini * n // max(mesh.dp, 1)
        if micro and per_rank % micro:
            checks.append(
                Check(
                    "mesh.batch-micro",
                    FAIL,
                    f"{per_rank} samples per data-parallel rank per mini-batch (mini {mini} x n {n} / DP {mesh.dp}) "
                    f"are not divisible by ppo_micro_batch_size_per_gpu {micro}",
                )
            )
    if not checks:
        per_rank = mini * n // max(mesh.dp, 1)
        checks.append(
            Check(
                "mesh.batch",
                OK,
                f"{train // mini} mini-batches per step, {per_rank} samples per data-parallel rank per mini-batch",
            )
        )
    return checks


def check_mesh(values: LaunchValues, num_layers: int, num_experts: int) -> tuple[list[Check], Parallelism | None]:
    """All mesh checks; returns them and the actor's mesh (the memory estimate uses it; None: not a Megatron actor).

    ``values`` is the typed view (verl_npu.preflight.values): every size here is an integer in range.
    """
    world = values.world
    checks = [Check("mesh.world", OK, f"{values.nnodes} nodes x {values.n_gpus_per_node} = {world}")]
    if values.actor is None:
        checks.append(
            Check(
                "mesh.actor-not-checked",
                WARN,
                f"actor: strategy {values.strategy}: preflight's device-mesh, batch-split and memory checks model "
                "Megatron engines only; the actor's mesh, batches and memory are not checked here (verl's own "
                "validation above did run)",
            )
        )
        return checks + check_rollout(values.rollout, world, num_experts), None
    actor = values.actor.parallelism
    checks += check_train_mesh("actor", actor, num_layers, num_experts)
    if values.ref is not None and values.ref.parallelism != actor:
        checks += check_train_mesh("ref", values.ref.parallelism, num_layers, num_experts)
    if values.critic is not None:
        checks += check_train_mesh("critic", values.critic.parallelism, num_layers, num_experts)
    checks += check_rollout(values.rollout, world, num_experts)
    checks += check_thd_alignment(values, values.actor)
    checks += check_batches(values, actor)
    if not failed(checks) and actor.dp == 0:
        checks.append(Check("mesh.actor-dp", WARN, "actor: no data-parallel ranks"))
    return checks, actor
