"""Kernel tests run on the GPU when there is one, else under Triton's interpreter.

TRITON_INTERPRET is read when triton is imported (triton.language's own
@jit helpers are built then) and when each kernel module is imported, so it
must be set before anything imports triton. The root tests/conftest.py sets
it first thing; this file repeats it for runs of this folder alone, and
fails the kernel tests with the fix spelled out if triton came in earlier in
compiled mode (on CPU that would give "Cannot call @triton.jit'd outside of
the scope of a kernel" deep in the interpreter).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON_COMPILED_MODE = "triton" in sys.modules and not _interpreting()

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _need_a_triton_target():
    if torch.cuda.is_available():
        return
    if not _interpreting():
        pytest.skip("no CUDA and TRITON_INTERPRET is off: Triton kernels cannot run")
    if _TRITON_COMPILED_MODE:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set; put "
            "os.environ.setdefault('TRITON_INTERPRET', '1') (when CUDA is absent) "
            "at the top of tests/conftest.py",
            pytrace=False,
        )
