"""The Drafter protocol: what the engine calls on every drafter, and the bound on a draft tree's size."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams

MAX_TREE_NODES = 64
DraftRequest = tuple[int, list[int], SpecConfig, SamplingParams, torch.Generator]  # the engine's draft args


DRAFTER_METHODS = ("prepare", "start", "draft", "draft_many", "commit", "finish")


class Drafter(Protocol):
    """What the engine calls. `target_hidden` is the target's final hidden state [n, D] of the tokens
    just run through the target (prompt minus its last token at start; the tree nodes at commit), for
    drafters that read target features (EAGLE, MTP); others ignore it.

    predicts_experts: True when the drafter fills `DraftTree.predicted_experts` (an expert predictor), which
    λ > 0 needs. prepare(lengths): size internal caches for sequences of these maximal lengths (called when a
    session starts). draft_many: `draft` for several requests at once (batched drafters use one forward per
    depth; others loop over `draft`).
    """

    predicts_experts: bool

    def prepare(self, lengths: list[int]) -> None: ...
    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None: ...
    def draft(
        self,
        seq_id: int,
        tokens: list[int],
        spec: SpecConfig,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree: ...
    def commit(
        self,
        seq_id: int,
        tokens: list[int],
        tree: DraftTree,
        accepted: list[int],
        target_hidden: torch.Tensor | None = None,
    ) -> None: ...
    def finish(self, seq_id: int) -> None: ...
    def draft_many(self, requests: list[DraftRequest]) -> list[DraftTree]: ...
