"""A drafter wrapper that remembers the trees it drafted: what Live-v0 prices a round's verified tree from."""

from __future__ import annotations

from typing import Any

from engine.spec.draft_tree import DraftTree


class CaptureDrafter:
    """A Drafter that delegates to another and remembers the trees it returned (the verified trees)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trees: dict[int, DraftTree] = {}

    @property
    def predicts_experts(self) -> bool:
        return bool(getattr(self.inner, "predicts_experts", False))

    def prepare(self, lengths: list[int]) -> None:
        self.inner.prepare(lengths)

    def start(self, seq_id, tokens, target_hidden=None) -> None:
        self.inner.start(seq_id, tokens, target_hidden=target_hidden)

    def draft(self, seq_id, tokens, spec, params, generator) -> DraftTree:
        return self.draft_many([(seq_id, tokens, spec, params, generator)])[0]

    def draft_many(self, requests):
        trees = self.inner.draft_many(requests)
        for req, tree in zip(requests, trees):
            self.trees[req[0]] = tree
        return trees

    def commit(self, seq_id, tokens, tree, accepted, target_hidden=None) -> None:
        self.inner.commit(seq_id, tokens, tree, accepted, target_hidden=target_hidden)

    def finish(self, seq_id) -> None:
        self.inner.finish(seq_id)

    def __getattr__(self, name: str) -> Any:  # `probe` and the like, where the inner drafter has them
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
