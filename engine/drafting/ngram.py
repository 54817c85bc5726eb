"""N-gram / prompt-lookup drafter (free): continuations of the longest earlier match of the suffix."""

from __future__ import annotations

import time

import torch

from engine.drafting.protocol import DraftRequest
from engine.drafting.suffix import suffix_continuations
from engine.drafting.tree_growth import _node_budget
from engine.spec.config import MAX_DEPTH, SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams


class NGramDrafter:
    """Prompt lookup: propose what followed earlier occurrences of the current suffix.

    For n from `max_ngram` down to `min_ngram`, find earlier positions where the last n committed
    tokens occurred; the continuations (most recent first, distinct first tokens become siblings)
    form a tree of width <= W and depth <= K. No model, no KV; draft laws are point masses. Continuations
    are chosen as for a depth-MAX_DEPTH draft and cut to K, so a shallower tree is a prefix of a deeper one
    (trace replay cuts recorded Kmax trees by depth: env.tables).
    """

    def __init__(self, vocab_size: int, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    predicts_experts = False  # no expert predictor: λ > 0 is refused by the engine

    def prepare(self, lengths: list[int]) -> None:
        """Nothing to size: no KV cache."""

    def draft_many(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self.draft(*req) for req in requests]

    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None:
        pass

    def finish(self, seq_id: int) -> None:
        pass

    def commit(self, seq_id, tokens, tree, accepted, target_hidden=None) -> None:
        pass

    def _continuations(self, tokens: list[int], depth: int, width: int) -> list[list[int]]:
        # chosen as for the deepest draft, then cut: a depth-K tree is the depth-K prefix of any deeper one
        return suffix_continuations(tokens, depth, width, self.max_ngram, self.min_ngram, select_depth=MAX_DEPTH)

    def draft(
        self,
        seq_id: int,
        tokens: list[int],
        spec: SpecConfig,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        t0 = time.perf_counter()
        conts = self._continuations(tokens, spec.depth, spec.width)
        budget = _node_budget(spec)
        tok, par, dep = [tokens[-1]], [-1], [0]
        for cont in conts:
            parent = 0
            for d, t in enumerate(cont, start=1):
                if len(tok) - 1 >= budget:
                    break
                tok.append(t)
                par.append(parent)
                dep.append(d)
                parent = len(tok) - 1
        n = len(tok)
        tree = DraftTree(
            tokens=torch.tensor(tok),
            parents=torch.tensor(par),
            depths=torch.tensor(dep),
            path_prob=torch.ones(n),
            confidence=[1.0] * (max(dep) if n > 1 else 0),
        )
        if spec.use_drafted_children and not params.greedy and n > 1:
            # point-mass draft law at each node with children; a node has one child in a chain
            q = torch.zeros(n, self.vocab_size)
            for i in range(1, n):
                q[par[i], tok[i]] = 1.0
            multi = torch.bincount(torch.tensor(par[1:]), minlength=n) > 1
            if bool(multi.any()):  # siblings are not i.i.d. draws: verify by target sampling instead
                q = None
            tree.draft_probs = q
        tree.draft_seconds = time.perf_counter() - t0
        return tree
