"""Small-M fp32 linear on CPU (C++ / AVX-512 or AVX2, `small_m.cpp`), with `F.linear` as its reference twin.

    from kernels.small_m import linear
    y = linear(x, w, b)      # == F.linear(x, w, b) [M, N]; the kernel when `supports(x, w, b)`, else F.linear

Why: a decode step multiplies one token row by each weight, a verification forward (or a batched decode step)
2-16. MKL reads a weight at 18-25 GB/s for M = 1 but at only 5-15 GB/s for M = 2..16 on the development CPU; this
kernel sweeps the input-major weight ([in, out] in memory, `engine.models.layout`) in memory order once for all
M <= 16 rows (kernels/sweep.h) at 19-37 GB/s for one row and 10-33 GB/s for 2-16 (cold weights, one thread;
README, issue 12), and keeps y[m, n] = bias[n] + Σ_k x[m, k] · w[n, k] summed over k in order, so a row's bits do
not depend on how many rows share the call (batch-invariant), and differ from MKL's by ~1e-6 relative (tested).

Strip-packed weights (`pack`, `packed`): a copy of W [N, K] as [ceil(N / S), K, S] (S = 32 columns on AVX-512,
16 on AVX2), so a pass over one strip reads memory in address order with its outputs in registers (sweep.h's
diagram). Same bits as the input-major sweep, 1.4-2.2x its read rate on the benchmark shapes (README, issue 12).
`linear(x, w, b, pack=True)` uses a cached packed copy of w (kept on the tensor, rebuilt when w changes); the copies
are extra memory, capped at EXPERTSPEC_PACK_MAX_MB (default: a quarter of the machine's memory) — past the cap, and
with packing off, weights are swept unpacked (same results). On by default with the AVX-512 build only
(`packing_default`; EXPERTSPEC_PACK=1 / 0 forces it).

The extension is compiled on first use with `torch.utils.cpp_extension` (~30 s once; cached under
~/.cache/torch_extensions) and used on a CPU with AVX-512 or AVX2 + FMA (kernels/simd.h). It is off when
`EXPERTSPEC_SMALL_M=0`, when no compiler is found, or when the build fails; `status()` says which, and everything
then runs F.linear.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from kernels.cpp_build import CppExtension, clear_stale_lock

MIN_ROWS, MAX_ROWS = 1, 16
MAX_PACKED_ROWS = 64  # a packed weight takes up to 64 rows (blocks of 16 per strip)

_EXT = CppExtension("small_m", "EXPERTSPEC_SMALL_M", ("-O3",), simd=True)
_state = _EXT.state  # {"module", "status"}
load = _EXT.load  # the compiled extension (built on the first call), or None when it is off
status = _EXT.status  # 'on (AVX-512)', 'on (AVX2)' or 'off (<why>)'
_clear_stale_lock = clear_stale_lock


def supports(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, max_rows: int = MAX_ROWS, packed: bool = False
) -> bool:
    """Whether `linear` takes the kernel: CPU fp32, no autograd, x [1 <= M <= max_rows, K] with contiguous rows,
    w [N, K] stored input-major (w.t() contiguous; any strides when read from its packed copy, `packed`), bias None
    or contiguous fp32, and the extension on."""
    return (
        x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= max_rows
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and w.dim() == 2
        and (packed or w.stride(0) == 1)
        and x.stride(1) == 1
        and (b is None or (b.dtype == torch.float32 and b.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and load() is not None
    )


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, pack: bool = False) -> torch.Tensor:
    """F.linear(x, w, b) for x [..., K], w [N, K]: the small-M kernel when `supports` it, else F.linear. pack: read
    w's strip-packed copy (`packed`: built on the first call and kept on w; the input-major sweep's bits) when there
    is one, then for up to MAX_PACKED_ROWS rows and whatever w's layout (a row-major w, which the sweep does not
    take, then gets the sweep's bits instead of BLAS's: ~1e-6 relative apart)."""
    if x.dim() == 2 and supports(x, w, b, MAX_PACKED_ROWS if pack else MAX_ROWS, packed=pack):
        p = packed(w) if pack else None
        if p is not None:  # up to 64 rows
            return _state["module"].small_m_linear_packed(x, p, w.shape[0], b)
        if x.shape[0] <= MAX_ROWS and w.stride(0) == 1:  # what `supports` asks of the sweep beyond the packed copy
            return _state["module"].small_m_linear(x, w.t(), b)
    return F.linear(x, w, b)


def strip_width() -> int:
    """S, the columns of one strip of a packed weight (32 with AVX-512, 16 with AVX2; 32 when the kernel is off)."""
    module = load()
    return module.strip_width() if module is not None else 32


def pack(w: torch.Tensor, strip: int | None = None) -> torch.Tensor:
    """The strip-packed copy of w [..., N, K] (any strides): [..., ceil(N / S), K, S] contiguous fp32 with
    P[..., s, k, j] = w[..., s S + j, k] and zeros past N (kernels/sweep.h). The reference of the layout."""
    S = strip or strip_width()
    N, K = w.shape[-2:]
    pad = (-N) % S
    w = w.detach()
    if pad:
        w = torch.cat([w, w.new_zeros(*w.shape[:-2], pad, K)], dim=-2)
    return w.reshape(*w.shape[:-2], -1, S, K).transpose(-1, -2).contiguous()


# bytes of live packed copies, their cap (EXPERTSPEC_PACK_MAX_MB) and the switch (`packing_default`), set on first use
_packs = {"bytes": 0, "cap": None, "on": None}


def packing_default() -> bool:
    """EXPERTSPEC_PACK=1 / 0 force packing on / off; unset, it is on with the AVX-512 build only. AVX2's strips hold
    16 columns (two 8-lane vectors), and on the AVX2 build the forward gained 0.95-1.2x (h256 / h512 on Zen 4,
    README) — not worth the memory of the copies; AVX-512's 32-column strips gain 1.2-1.8x."""
    env = os.environ.get("EXPERTSPEC_PACK", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"EXPERTSPEC_PACK must be 1 (pack), 0 (do not) or unset (AVX-512 builds pack), got {env!r}")
    if env:
        return env == "1"
    return status() == "on (AVX-512)"


def _cap_bytes() -> int:
    if _packs["cap"] is None:
        mb = os.environ.get("EXPERTSPEC_PACK_MAX_MB")
        if mb is not None:
            try:
                _packs["cap"] = int(float(mb) * 2**20)
            except ValueError:
                raise ValueError(f"EXPERTSPEC_PACK_MAX_MB must be a number of MB, got {mb!r}") from None
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
            _packs["cap"] = total // 4 if total > 0 else 2**30
    return _packs["cap"]


def _release(nbytes: int) -> None:
    _packs["bytes"] -= nbytes


def packed(w: torch.Tensor) -> torch.Tensor | None:
    """w's strip-packed copy (`pack`), cached on w and rebuilt when w's storage, in-place version, shape or strides
    change; None when packing is off (EXPERTSPEC_PACK=0, no kernel, not CPU fp32) or the copy would pass the cap."""
    on = _packs["on"]
    if on is None:
        on = _packs["on"] = packing_default()
    if not on:
        return None
    # inference tensors (the fused caches) carry no version counter; they are rebuilt, never written in place
    key = (w.data_ptr(), -1 if w.is_inference() else w._version, w.shape, w.stride())
    cached = w.__dict__.get("_expertspec_packed")
    if cached is not None and cached[0] == key:  # the hot path: one forward asks ~6 times per layer
        return cached[1]
    if w.device.type != "cpu" or w.dtype != torch.float32 or load() is None:
        return None
    S = strip_width()
    nbytes = -(-w.shape[-2] // S) * S * w.shape[-1] * w[..., :1, :1].numel() * 4
    if _packs["bytes"] + nbytes > _cap_bytes():  # refused for good while w is unchanged: its bits never switch
        w.__dict__["_expertspec_packed"] = (key, None)
        return None
    p = pack(w, S)
    _packs["bytes"] += nbytes
    weakref.finalize(p, _release, nbytes)
    w.__dict__["_expertspec_packed"] = (key, p)
    return p
