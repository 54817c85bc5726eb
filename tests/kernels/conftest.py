"""Kernel tests run the Triton kernels on CPU tensors in the Triton interpreter.

TRITON_INTERPRET=1 only takes effect if it is set before triton is first imported, so it is set here,
at conftest import, when triton is not loaded yet and there is no GPU (on a GPU machine the `gpu`
tests want compiled kernels). When triton was imported earlier in this process (a whole-suite run, or
a GPU machine), the interpreter tests skip themselves and `test_interpreter_fallback.py` reruns them
in a fresh subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels._launch import interpreter_active  # noqa: E402
from kernels.moe_align import _moe_align_kernel  # noqa: E402

INTERPRETER_REASON = (
    "triton was imported before TRITON_INTERPRET=1 could be set; "
    "tests/kernels/test_interpreter_fallback.py reruns this test in a subprocess"
)


@pytest.fixture
def triton_cpu() -> None:
    """Skip unless Triton kernels can run on CPU tensors in this process."""
    if not interpreter_active(_moe_align_kernel):
        pytest.skip(INTERPRETER_REASON)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machines are small and shared
    yield
    torch.set_num_threads(threads)
