"""CI support: the baseline comparator for nightly training logs and manifest-derived image tags."""
