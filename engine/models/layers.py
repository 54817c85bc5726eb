"""Small building blocks shared by the attention variants: RMSNorm, RoPE application, query (un)padding.

RoPE uses the HF rotate-half layout over the first rd = cos.shape[-1] dims of a head (rd < head_dim:
partial rotary, glm4_moe); the remaining dims pass through unrotated.

Shape letters: B=requests Tq=padded query length N=packed tokens hd=head dim rd=rotary dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_decode


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def add_norm(norm: RMSNorm, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, norm(h + delta)) for rows h [N, D] (delta None: h itself): one fused C++ call on CPU fp32
    (`kernels.cpu_decode`), else the torch ops."""
    if h.dim() == 2 and norm.weight.dtype == torch.float32 and cpu_decode.applies(h):
        return cpu_decode.add_rms_norm(h, delta, norm.weight, norm.eps)
    h = h if delta is None else h + delta
    return h, norm.forward(h)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Inference RoPE: rotate_half(x) * sin == roll(x, rd/2) * [-sin, sin] exactly (negation is exact),
    two ops fewer. x [..., heads, hd]; cos, sin_signed [..., rd]."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope_signed(x[..., :rd], cos, sin_signed), x[..., rd:]], dim=-1)
    return x * cos.unsqueeze(-2) + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed.unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, hd]; cos/sin [..., rd] broadcast over heads."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def sign_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., rd] -> [-sin, sin] halves, the table `apply_rope_signed` reads."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def pad_queries(x: torch.Tensor, batch) -> torch.Tensor:
    """Packed x [N, ...] -> [B, Tq, ...] by `batch.pad_index` (padding cells are zeros)."""
    B, Tq = batch.pad_index.shape
    if B == 1 and Tq == x.shape[0]:
        return x.unsqueeze(0)
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[batch.pad_index]


def unpad_queries(out: torch.Tensor, batch) -> torch.Tensor:
    """[B, Tq, ...] -> packed [N, ...] (inverse of `pad_queries`)."""
    B, Tq = batch.pad_index.shape
    if B == 1 and Tq == batch.num_tokens:
        return out[0]
    return out.reshape(B * Tq, *out.shape[2:])[unpad_index(batch)]


def unpad_index(batch) -> torch.Tensor:
    """Flat [B*Tq] positions of the N packed tokens, in packed order."""
    if batch.unpad_order is not None:
        return batch.unpad_order
    flat = batch.pad_index.reshape(-1)
    valid = (flat < batch.num_tokens).nonzero().squeeze(1)
    order = torch.empty(batch.num_tokens, dtype=torch.long, device=flat.device)
    order[flat[valid]] = valid
    return order
