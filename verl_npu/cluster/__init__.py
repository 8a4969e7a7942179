"""Cluster bring-up checks for multi-node launches (Ray registration, collective smoke test)."""
