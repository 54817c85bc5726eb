"""Launch a @triton.jit kernel: compiled on CUDA tensors, Triton interpreter on CPU tensors.

Triton picks compiled vs interpreted when `@triton.jit` runs (for its own `tl.*` helpers: when triton
is imported), from the environment variable TRITON_INTERPRET. So Triton on CPU tensors works only in
a process that set TRITON_INTERPRET=1 before importing triton; otherwise `launch` raises a clear error
instead of Triton's "pointer argument cannot be accessed from Triton (cpu tensor?)".
"""

from __future__ import annotations

from typing import Any

import torch


def interpreter_active(kernel: Any) -> bool:
    """True iff `kernel` was decorated under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Run `kernel[grid](*args, **kwargs)` after checking that CPU tensors can reach it."""
    on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
    if on_cpu and not interpreter_active(kernel):
        raise RuntimeError(
            "Triton kernels on CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 in the "
            "environment before triton is first imported, or use backend='torch' (the reference)."
        )
    kernel[grid](*args, **kwargs)
