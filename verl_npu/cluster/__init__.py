"""Cluster bring-up for multi-node launches: each node's network (interfaces, ports, device NICs), Ray
registration and the collective smoke test."""
