"""verl-npu operators: portable PyTorch implementations the patch layer and engine dispatch to."""
