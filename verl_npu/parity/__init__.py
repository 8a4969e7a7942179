"""Platform parity: a deterministic engine-level job whose numbers an Ascend run must share with the CUDA reference.

``verl-npu parity run`` (job.py) runs the parity models (models.py) through the verl-npu engine and records what
it sees (probes.py); ``verl-npu parity compare`` and ``parity reference`` (compare.py) judge a run against the
reference recorded on nvidia-h200 (ci/baselines/parity/reference.json) with tolerances measured there.
"""
