"""Small-M fp32 linear on CPU (C++ / AVX-512 or AVX2, `small_m.cpp`), with `F.linear` as its reference twin.

    from kernels.small_m import linear
    y = linear(x, w, b)      # == F.linear(x, w, b) [M, N]; the kernel when `supports(x, w, b)`, else F.linear

Why: a decode step multiplies one token row by each weight, a verification forward (or a batched decode step)
2-16. MKL reads a weight at 18-25 GB/s for M = 1 but at only 5-15 GB/s for M = 2..16 on the development CPU; this
kernel sweeps the input-major weight ([in, out] in memory, `engine.models.layout`) in memory order once for all
M <= 16 rows (kernels/sweep.h) at 19-37 GB/s for one row and 10-33 GB/s for 2-16 (cold weights, one thread;
README, issue 12), and keeps y[m, n] = bias[n] + Σ_k x[m, k] · w[n, k] summed over k in order, so a row's bits do
not depend on how many rows share the call (batch-invariant), and differ from MKL's by ~1e-6 relative (tested).

The extension is compiled on first use with `torch.utils.cpp_extension` (~30 s once; cached under
~/.cache/torch_extensions) and used on a CPU with AVX-512 or AVX2 + FMA (kernels/simd.h). It is off when
`EXPERTSPEC_SMALL_M=0`, when no compiler is found, or when the build fails; `status()` says which, and everything
then runs F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpp_build import CppExtension, clear_stale_lock

MIN_ROWS, MAX_ROWS = 1, 16

_EXT = CppExtension("small_m", "EXPERTSPEC_SMALL_M", ("-O3",), simd=True)
_state = _EXT.state  # {"module", "status"}
load = _EXT.load  # the compiled extension (built on the first call), or None when it is off
status = _EXT.status  # 'on (AVX-512)', 'on (AVX2)' or 'off (<why>)'
_clear_stale_lock = clear_stale_lock


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """Whether `linear` takes the kernel: CPU fp32, no autograd, x [1 <= M <= 16, K] with contiguous rows, w [N, K]
    stored input-major (w.t() contiguous), bias None or contiguous fp32, and the extension on."""
    return (
        x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.stride(0) == 1
        and x.stride(1) == 1
        and (b is None or (b.dtype == torch.float32 and b.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and load() is not None
    )


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) for x [..., K], w [N, K]: the small-M kernel when `supports` it, else F.linear."""
    if x.dim() == 2 and supports(x, w, b):
        return _state["module"].small_m_linear(x, w.t(), b)
    return F.linear(x, w, b)
