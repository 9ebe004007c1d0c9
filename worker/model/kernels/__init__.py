"""Triton kernels for the worker, one file each: the @triton.jit kernel, a
wrapper that checks its inputs and launches it, and a ``*_ref`` in plain
PyTorch that the tests in tests/kernels compare against.

Nothing is imported here, so ``import worker.model.kernels`` does not import triton
(TRITON_INTERPRET must be set before triton's first import for CPU tests).
"""
