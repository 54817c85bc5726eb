"""Expert placement strategies, their validation, and rank loads of a virtual EP layout."""

import pytest
import torch

from engine.parallel.placement import ExpertPlacement, layout_stats, place_experts, rank_loads


@pytest.mark.parametrize("strategy", ["contiguous", "round_robin", "load_balanced", "replicated"])
def test_every_strategy_covers_every_expert(strategy):
    counts = torch.arange(16, 0, -1).float()
    p = place_experts(16, 4, strategy, ranks_per_node=2, expert_counts=counts, num_replicated=2)
    assert all(len(r) >= 1 for r in p.expert_ranks)
    assert sorted({e for held in p.rank_experts for e in held}) == list(range(16))
    if strategy == "replicated":
        assert p.replicated_experts == (0, 1)  # the two hottest, on every rank
        assert all(p.expert_ranks[e] == (0, 1, 2, 3) for e in (0, 1))


def test_contiguous_and_round_robin_layouts():
    assert place_experts(8, 4, "contiguous").expert_ranks == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    assert place_experts(8, 4, "round_robin").expert_ranks == ((0,), (1,), (2,), (3,)) * 2


def test_load_balanced_beats_contiguous_on_skewed_counts():
    gen = torch.Generator().manual_seed(0)
    popularity = 1.0 / torch.arange(1, 33).float()  # Zipf: hot experts have low ids
    expert_ids = torch.stack([torch.multinomial(popularity, 4, generator=gen) for _ in range(2000)])  # [T, r]
    counts = torch.bincount(expert_ids.reshape(-1), minlength=32)
    contiguous = rank_loads(expert_ids, place_experts(32, 8, "contiguous"))
    balanced_p = place_experts(32, 8, "load_balanced", expert_counts=counts)
    balanced = rank_loads(expert_ids, balanced_p)
    assert balanced.imbalance < 0.6 * contiguous.imbalance  # about 1.7 vs 3.6
    assert max(len(h) for h in balanced_p.rank_experts) == 4  # memory stays balanced: E/W experts per rank
    # expert 0 alone takes 1.45x a rank's mean share; a replica on every rank serves it locally
    hot = place_experts(32, 8, "replicated", expert_counts=counts, num_replicated=2)
    replicated = rank_loads(expert_ids, hot, token_rank=torch.arange(2000) % 8)
    assert replicated.imbalance < 1.2 < balanced.imbalance


def test_validation_errors():
    with pytest.raises(ValueError, match=r"drops expert\(s\) \[1\]"):
        ExpertPlacement(3, 2, 2, ((0,), (), (1,)))
    with pytest.raises(ValueError, match="lists 2 experts, expected 3"):
        ExpertPlacement(3, 2, 2, ((0,), (1,)))
    with pytest.raises(ValueError, match=r"rank\(s\) \[5\] outside the world \[0, 2\)"):
        ExpertPlacement(2, 2, 2, ((0,), (5,)))
    for strategy in ("contiguous", "round_robin"):
        with pytest.raises(ValueError, match="world size .4. to divide the expert count .10."):
            place_experts(10, 4, strategy)
        with pytest.raises(ValueError, match="divide"):
            ExpertPlacement(10, 4, 2, tuple((e % 4,) for e in range(10)), strategy)
    assert len(place_experts(10, 4, "load_balanced").expert_ranks) == 10  # allowed without divisibility
    with pytest.raises(ValueError, match="available: contiguous"):
        place_experts(8, 4, "zigzag")
    with pytest.raises(ValueError, match="num_replicated"):
        place_experts(8, 4, "replicated")


def test_rank_loads_known_answer():
    # 4 ranks, 2 per node; expert e lives on rank e
    p = ExpertPlacement(4, 4, 2, ((0,), (1,), (2,), (3,)))
    expert_ids = torch.tensor([[0, 1], [2, 3], [0, 2]])
    loads = rank_loads(expert_ids, p, token_rank=torch.tensor([0, 0, 3]))
    assert loads.assignments == (2, 1, 2, 1)
    assert loads.imbalance == pytest.approx(2 / 1.5)
    # token 0 (node 0): experts 0, 1 on node 0; token 1 (node 0): experts 2, 3 on node 1 -> 2 cross;
    # token 2 (node 1): expert 0 on node 0 -> cross, expert 2 on node 1 -> local
    assert loads.cross_node_ratio == pytest.approx(3 / 6)
    assert loads.cross_rank_ratio == pytest.approx(5 / 6)
    empty = rank_loads(torch.zeros(0, 2, dtype=torch.long), p)
    assert (empty.imbalance, empty.cross_node_ratio, empty.assignments) == (1.0, 0.0, (0, 0, 0, 0))
    balanced = rank_loads(torch.tensor([[0, 1], [2, 3]]), p)
    assert balanced.imbalance == 1.0


def test_replica_choice():
    # expert 0 on ranks 1 and 2; ranks 0,1 are node 0 and ranks 2,3 are node 1
    p = ExpertPlacement(3, 4, 2, ((1, 2), (2,), (3,)))
    own_node = rank_loads(torch.tensor([[0], [0]]), p, token_rank=torch.tensor([0, 3]))
    assert own_node.assignments == (0, 1, 1, 0) and own_node.cross_node_ratio == 0.0
    own_rank = rank_loads(torch.tensor([[0]]), p, token_rank=torch.tensor([2]))
    assert own_rank.assignments == (0, 0, 1, 0) and own_rank.cross_rank_ratio == 0.0
    # no replica on the token's node: least-loaded replica (rank 2 already holds expert 1's assignment)
    q = ExpertPlacement(3, 4, 2, ((2, 3), (2,), (0,)))
    far = rank_loads(torch.tensor([[1, 0]]), q, token_rank=torch.tensor([0]))
    assert far.assignments == (0, 0, 1, 1) and far.cross_node_ratio == 1.0


def test_layout_stats_summary():
    p = ExpertPlacement(4, 4, 2, ((0,), (1,), (2,), (3,)))
    routing = [
        torch.tensor([[0, 1], [2, 3]]),
        torch.tensor([[0, 1], [0, 1]]),
    ]  # balanced, then two ranks only
    stats = layout_stats(routing, p)
    assert stats.imbalance_max == pytest.approx(2.0) and stats.imbalance_mean == pytest.approx(1.5)
    assert stats.cross_node_ratio == pytest.approx(2 / 8)  # token rank 0: experts 2, 3 live on node 1
