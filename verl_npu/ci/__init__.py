"""CI support: the baseline comparator for nightly training logs, manifest-derived image tags, and the
nightly jobs' GSM8K preparation."""
