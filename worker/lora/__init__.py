"""LoRA adapters: PEFT files checked against the model (adapter.py), every adapter stacked per
layer with slot 0 for none (adapter_set.py), the layers that add their deltas (linear.py) and the
batched delta itself (delta.py: the PyTorch path, and the Triton kernels on CUDA)."""
