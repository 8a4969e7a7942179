"""verl-npu: the Ascend NPU platform distribution of verl.

Kept free of imports: install.sh runs ``python -m verl_npu.stack`` with the bare host Python, and
``verl_npu.megatron_adaptor`` is imported by every verl process.
"""

__version__ = "0.1.0"
