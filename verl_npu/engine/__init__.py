"""The NPU Megatron engine: build plan, offload manager, and the thin verl-facing engine classes."""
