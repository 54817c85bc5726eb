"""Published EAGLE-3 heads (SpecForge / SGLang / vLLM `LlamaForCausalLMEagle3`, 2503.01840) as tree drafters.

The engine asks the target for the head's auxiliary layers (`feature_layers`, the residual streams entering
three target layers) on every prefill and verification forward and hands them in at start / commit; they are
fused by the head's `fc` right away, so the `EagleDrafter` recursion runs on width-D features: true fused
target features for committed positions, the head's own pre-norm outputs for tree nodes (as SGLang and vLLM
chain). Draft logits live on the reduced draft vocabulary and are mapped to target ids through `d2t`
(every other target token has draft probability 0), so the tree machinery, verification and the exact
acceptance rules see target-vocabulary distributions.
"""

from __future__ import annotations

import os

import torch

from engine.drafting.feature_drafter import EagleDrafter
from engine.models.batching import PackItem, pack
from engine.models.eagle3 import Eagle3Head, load_eagle3_head
from engine.models.expert_predictor import ExpertPredictor
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model
from engine.spec.draft_tree import DraftTree


class Eagle3Drafter(EagleDrafter):
    """An `EagleDrafter` over an `Eagle3Head`; `feature_layers` tells the engine which target states to capture."""

    def __init__(
        self,
        head: Eagle3Head,
        target: Model,
        feature_layers: tuple[int, ...],
        predictor: ExpertPredictor | None = None,
        **kv_options,
    ) -> None:
        if not isinstance(head, Eagle3Head):
            raise TypeError(f"Eagle3Drafter needs an Eagle3Head, got {type(head).__name__}")
        self.feature_layers = tuple(feature_layers)
        super().__init__(head, target, predictor, **kv_options)

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        return self.head.new_cache(num_blocks, self.block_size, self.target.dtype, self.target.device)

    def _fused(self, target_hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Auxiliary states [n, 3 Dt] -> fused features [n, D]."""
        if target_hidden is None:
            return None
        width = 3 * self.head.config.hidden_size
        if target_hidden.shape[-1] != width:
            raise ValueError(f"Eagle3Drafter needs the target's auxiliary states [n, {width}] (the engine captures "
                             f"feature_layers={self.feature_layers}), got {tuple(target_hidden.shape)}")  # fmt: skip
        with torch.inference_mode():
            return self.head.fuse_target(target_hidden.to(self.target.dtype))

    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None:
        super().start(seq_id, tokens, self._fused(target_hidden))

    def commit(
        self,
        seq_id: int,
        tokens: list[int],
        tree: DraftTree,
        accepted: list[int],
        target_hidden: torch.Tensor | None = None,
    ) -> None:
        super().commit(seq_id, tokens, tree, accepted, self._fused(target_hidden))

    def _run(self, items: list[PackItem], features: torch.Tensor) -> torch.Tensor:
        batch = pack(items, self.target.device)
        token_emb = self.head.embed_tokens(batch.input_ids)
        return self.head.forward_cached(features.to(self.target.dtype), token_emb, batch, self.kv)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.target_logits(out).float()


def load_eagle3_drafter(
    path: str | os.PathLike, target: Model, predictor: ExpertPredictor | None = None, **kv_options
) -> Eagle3Drafter:
    """An EAGLE-3 head folder -> `Eagle3Drafter` over `target` (all fit checks before any work)."""
    head, capture = load_eagle3_head(path, target)
    return Eagle3Drafter(head, target, capture, predictor, **kv_options)
