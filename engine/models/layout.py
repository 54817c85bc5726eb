"""Weight memory layout for decode on CPU: each matmul weight in the layout its gemv streams fastest.

A decode step multiplies one (or a few) token rows by each weight: y [M, out] = x [M, in] @ W.T. With the
weight in its PyTorch / HF layout W [out, in] (row-major), MKL runs a transposed gemv that reads a wide weight
(out >= in: q/k/v, gate/up, router, LM head) at ~10 GB/s on the development CPU; kept as a column-major view
of an [in, out] row-major buffer (`W.t().contiguous().t()`, "input-major"), `F.linear(x, W)` hands BLAS a
contiguous [in, out] matrix and the gemv streams it at ~20-25 GB/s, the machine's read bandwidth. Narrow
weights (out < in: the down projections into the hidden size) read faster row-major, so they stay so
(measured side by side: `python -m engine.bench`, and the numbers in `preferred_layout`).

The values are unchanged, only the strides: every module keeps calling `F.linear(x, W)`, checkpoints and
parameter names stay HF's, and `fused_weight` gives fused parts the same treatment. Only the summation order
inside BLAS changes (logits move by ~1e-6 relative). Applied by `engine.load_model` on CPU; GPU tensor-core
GEMMs prefer the row-major [out, in] layout, so CUDA tensors are left as they are.

The C++ CPU path reads faster still from a strip-packed copy of each weight ([ceil(out / 32), in, 32], no strided
view of [out, in]); those copies are not parameters: `kernels.small_m.packed` builds and caches them on first use.
"""

from __future__ import annotations

import torch
from torch import nn


def is_input_major(w: torch.Tensor) -> bool:
    """True when the last two dims of w [..., out, in] are stored column-major ([..., in, out] in memory)."""
    return w.dim() >= 2 and w.transpose(-1, -2).is_contiguous()


def input_major(w: torch.Tensor) -> torch.Tensor:
    """The same values [..., out, in] stored as [..., in, out] in memory (a no-op when already so)."""
    if w.dim() < 2 or is_input_major(w):
        return w
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def preferred_layout(w: torch.Tensor) -> torch.Tensor:
    """w [..., out, in] in the layout whose gemv streams fastest on CPU: input-major when out >= in, else
    row-major. Cold-cache gemv, one thread, development CPU (MKL): [1024, 384] 9.5 GB/s row-major vs 19 input-
    major, [8192, 384] 9.6 vs 21; [384, 1024] 15.8 vs 9.1, [384, 2048] 15.6 vs 8.8. CUDA tensors: unchanged."""
    if w.dim() < 2 or w.device.type != "cpu":
        return w
    if w.shape[-2] >= w.shape[-1]:
        return input_major(w)
    return w if w.is_contiguous() else w.contiguous()


def use_decode_layout(model: nn.Module) -> nn.Module:
    """Re-lay (`preferred_layout`) every matmul weight of `model` in place: 2-D `nn.Linear` weights and 3-D
    stacked expert weights [E, out, in]; embeddings keep their rows contiguous unless tied to the LM head."""
    targets: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            linear_weight = isinstance(module, nn.Linear) and name == "weight"
            stacked = p.dim() == 3 and not isinstance(module, nn.Embedding)
            if (linear_weight or stacked) and p.device.type == "cpu":
                targets[id(p)] = p  # a tied embedding / LM head matrix counts once, as the LM head
    for p in targets.values():
        p.data = preferred_layout(p.data)
    return model
