"""What a parity run file is: its kind, its format, the dtypes a run is made in and the most steps it records.

The job writes run files (verl_npu/parity/job.py) and compare reads them (verl_npu/parity/compare.py); both take
these from here.
"""

from __future__ import annotations

RUN_KIND = "verl-npu parity run"
FORMAT = 2  # 2: block-boundary tensors and replay (parity/replay.py), step-0 gradient and update sketches
DTYPES = ("bf16", "fp32", "fp64")
MAX_STEPS = 100  # a run records every step's loss and gradient norm per model: a few steps say what parity needs
