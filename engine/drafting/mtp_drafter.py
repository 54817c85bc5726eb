"""`drafter="mtp"`: the MTP module shipped in a DeepSeek-V3 / GLM-4.5 checkpoint as a tree drafter.

The module (engine.models.mtp) is applied recursively, depth by depth, exactly like an EAGLE head
(`EagleDrafter`: KV alignment with true target features at start / commit, bounded-frontier trees, drafted
or deterministic children). What differs: the module's own cache layout (MLA: latents), its own
embedding and output head (`shared_head.head`, the checkpoint's copies), and its features are already
normalised (no separate readout).
"""

from __future__ import annotations

import os

import torch

from engine.drafting.feature_drafter import EagleDrafter
from engine.models.batching import PackItem, pack
from engine.models.expert_predictor import ExpertPredictor
from engine.models.kv_cache import PagedKVCache
from engine.models.mtp import CheckpointMTP, load_checkpoint_mtp
from engine.models.transformer import Model


class CheckpointMTPDrafter(EagleDrafter):
    """An `EagleDrafter` over a `CheckpointMTP` module."""

    def __init__(self, head: CheckpointMTP, target: Model, predictor: ExpertPredictor | None = None, **kv_options):
        if not isinstance(head, CheckpointMTP):
            raise TypeError(f"CheckpointMTPDrafter needs a CheckpointMTP, got {type(head).__name__}")
        super().__init__(head, target, predictor, **kv_options)

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        t = self.target
        return self.head.new_cache(num_blocks, self.block_size, t.dtype, t.device)

    def _run(self, items: list[PackItem], features: torch.Tensor) -> torch.Tensor:
        batch = pack(items, self.target.device)
        token_emb = self.head.embed_tokens(batch.input_ids)
        return self.head.forward_cached(features.to(self.target.dtype), token_emb, batch, self.kv)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.logits(out).float()


def load_mtp_drafter(
    target: Model, path: str | os.PathLike | None = None, predictor: ExpertPredictor | None = None, **kv_options
) -> CheckpointMTPDrafter:
    """`drafter="mtp"`: the target's shipped MTP module (from `path`, default the target's own folder)."""
    return CheckpointMTPDrafter(load_checkpoint_mtp(target, path), target, predictor, **kv_options)
