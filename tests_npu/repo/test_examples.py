"""The GLM-5.2 launch composes against verl 0.9.1's own Hydra schema and forwards extra overrides."""

from __future__ import annotations

import json

from support.example_launch import LAUNCH, launch


def test_glm5_launch_composes_with_verls_schema(tmp_path):
    done = launch(tmp_path, "trainer.total_training_steps=3")
    assert done.returncode == 0, done.stderr
    cfg = json.loads(done.stdout)["config"]
    actor = cfg["actor_rollout_ref"]["actor"]
    mcore = actor["megatron"]
    assert (cfg["trainer"]["nnodes"], cfg["trainer"]["n_gpus_per_node"]) == (32, 16)
    assert cfg["trainer"]["total_training_steps"] == 3  # "$@" reaches the trainer
    assert (mcore["tensor_model_parallel_size"], mcore["pipeline_model_parallel_size"]) == (2, 8)
    assert (mcore["context_parallel_size"], mcore["expert_model_parallel_size"]) == (4, 64)
    assert mcore["param_offload"] and mcore["optimizer_offload"] and mcore["use_distributed_optimizer"]
    assert actor["optim"]["use_precision_aware_optimizer"] is True
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.28)
    assert actor["checkpoint"]["strict"] is False
    assert cfg["data"]["max_prompt_length"] == 24576 and cfg["data"]["max_response_length"] == 8192
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert (rollout["tensor_model_parallel_size"], rollout["data_parallel_size"], rollout["n"]) == (8, 8, 8)
    assert mcore["override_transformer_config"]["num_layers_in_first_pipeline_stage"] == 9
    # the rollout: one request of prompt + response fits vLLM's KV cache (verl would pass max_position_embeddings,
    # 1,048,576), and decode-only graphs reach vLLM through engine_kwargs (verl pops compilation_config there)
    assert rollout["max_model_len"] == 24576 + 8192
    assert rollout["engine_kwargs"]["vllm"]["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert rollout["enforce_eager"] is False


def test_a_removed_key_is_rejected_by_the_schema(tmp_path):
    done = launch(tmp_path, "actor_rollout_ref.actor.megatron.grad_offload=True")
    assert done.returncode == 2
    assert "grad_offload" in done.stderr


def test_the_env_file_supplies_paths_and_cluster_shape(tmp_path):
    env_file = tmp_path / "site.env"
    shipped = (LAUNCH.parent / "glm5_2.env").read_text()
    env_file.write_text(shipped.replace("/models/GLM-5.2", "/mnt/glm").replace("NNODES=32", "NNODES=2"))
    done = launch(tmp_path, ENV_FILE=str(env_file))
    assert done.returncode == 0, done.stderr
    cfg = json.loads(done.stdout)["config"]
    assert cfg["actor_rollout_ref"]["model"]["path"] == "/mnt/glm" and cfg["trainer"]["nnodes"] == 2


def test_a_missing_env_file_stops_the_launch(tmp_path):
    done = launch(tmp_path, ENV_FILE=str(tmp_path / "absent.env"))
    assert done.returncode != 0 and "absent.env" in done.stderr
