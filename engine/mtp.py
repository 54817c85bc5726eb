"""Multi-token prediction (MTP) module as a drafter (DeepSeek-V3, 2412.19437 §2.2).

    h'_t = M [RMSNorm(h_t) ; RMSNorm(emb(x_{t+1}))]      M: [2D] -> [D], no bias
    o_t  = TRM(h'_t)                                     one transformer block (engine.model.DecoderLayer)
    P(x_{t+2}) = softmax(lm_head(RMSNorm(o_t)))          the target's shared, frozen output head

h_t is the target's final feature at position t (whose own head predicts x_{t+1}), so the module sees the
next token and predicts the one after it; it is trained with cross-entropy on x_{t+2} over a frozen
target (engine/train_heads.py). DeepSeek-V3 chains D sequential modules, module k reading module k-1's
output o; we apply the one trained module recursively (o_t is the next depth's h), which is exactly the
EAGLE drafting recursion, so `MTPDrafter` is `engine.eagle.EagleDrafter` over an `MTPHead`: same KV
alignment (true target features at start/commit), tree expansion, drafted/deterministic children and
expert-aware selection. The difference to EAGLE is the fusion (normalised inputs, no bias), the output
norm, and the training objective (next-next token, not feature regression).

Shape letters: D=hidden.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from torch import nn

from .eagle import EagleDrafter, FeatureHead, HeadConfig, load_head
from .expert_predictor import ExpertPredictor
from .model import Model, RMSNorm


class MTPHead(FeatureHead):
    """The MTP module; parameter names follow DeepSeek-V3's (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`)."""

    model_type: ClassVar[str] = "expertspec_mtp"
    feature_space: ClassVar[str] = "mtp"

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        D = cfg.hidden_size
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.out_norm = RMSNorm(D, cfg.rms_norm_eps)

    def fuse(self, features: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """features (h_t), token_emb (emb(x_{t+1})) [..., D] -> h'_t [..., D]."""
        return self.eh_proj(torch.cat([self.hnorm(features), self.enorm(token_emb.to(features.dtype))], dim=-1))

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """o_t [..., D] -> RMSNorm(o_t), what the shared lm_head reads."""
        return self.out_norm(out)


def load_mtp_head(path: str | os.PathLike, target: Model) -> MTPHead:
    """`zoo/mtp-head` -> MTPHead on the target's device and dtype."""
    return load_head(path, target, MTPHead)  # type: ignore[return-value]


class MTPDrafter(EagleDrafter):
    """`EagleDrafter` over an `MTPHead` (depth k by recursive application of the module)."""

    def __init__(self, head: MTPHead, target: Model, predictor: ExpertPredictor | None = None, **kv_options) -> None:
        if not isinstance(head, MTPHead):
            raise TypeError(f"MTPDrafter needs an MTPHead, got {type(head).__name__}")
        super().__init__(head, target, predictor, **kv_options)
