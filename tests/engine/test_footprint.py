"""round_footprint (engine.runtime.footprint): the vectorised counts equal a per-layer reference."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.footprint import round_footprint


def _reference(ids: list[torch.Tensor], E: int, prev: torch.Tensor | None):
    counts = torch.stack([torch.bincount(e.reshape(-1), minlength=E) for e in ids])
    pairs = counts > 0
    n = ids[0].shape[0]
    root = sum(int(torch.unique(e[0]).numel()) for e in ids)
    new = (int(pairs.sum()) - root) / (n - 1) if n > 1 else 0.0
    overlap = None if prev is None else float((pairs & prev).sum()) / max(int(pairs.sum()), 1)
    return counts, pairs.sum(1).tolist(), new, overlap


@pytest.mark.parametrize("n,L,E,r", [(1, 3, 8, 2), (5, 4, 16, 2), (17, 6, 64, 8), (3, 48, 128, 8)])
def test_round_footprint_equals_the_per_layer_reference(n, L, E, r):
    gen = torch.Generator().manual_seed(n * L)
    ids = [torch.stack([torch.randperm(E, generator=gen)[:r] for _ in range(n)]) for _ in range(L)]
    prev = torch.rand(L, E, generator=gen) < 0.2
    fp = round_footprint(ids, E, prev)
    counts, distinct, new, overlap = _reference(ids, E, prev)
    assert torch.equal(fp.tokens_per_expert, counts) and fp.distinct_experts == distinct
    assert fp.new_pairs_per_node == pytest.approx(new) and fp.overlap_prev == pytest.approx(overlap)
    assert fp.reuse == pytest.approx(1 - sum(distinct) / (n * L * r))


def test_round_footprint_refuses_non_local_ids():
    with pytest.raises(ValueError, match="expert ids >= 0"):
        round_footprint([torch.tensor([[0, -1]])], 4, None)


def test_round_footprint_takes_the_stacked_routing_too():
    gen = torch.Generator().manual_seed(1)
    ids = [torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(6)]) for _ in range(5)]  # L x [n, r]
    a, b = round_footprint(ids, 32, None), round_footprint(torch.stack(ids, 1), 32, None)
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert) and a.new_pairs_per_node == b.new_pairs_per_node
