"""Synthetic router: fit to recorded routing, temporal overlap, tree conditioning, determinism, footprint."""

import os
from pathlib import Path

import pytest
import torch

from engine.cost.synthetic_router import (
    DEFAULT_CALIBRATIONS,
    RouterCalibration,
    SyntheticRouter,
    calibrate,
    crosslayer_mutual_information,
    distinct_experts_curve,
    gini,
    rank_aligned_joint,
    top_r_overlap,
    with_overrides,
)

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("EXPERTSPEC_SHARED_DATA", REPO.parent / "shared" / "data"))
ROUTING = SHARED_DATA / "routing" / "olmoe_mixtral_github_expert_counts.json"
needs_data = pytest.mark.skipif(not ROUTING.is_file(), reason=f"no routing record at {ROUTING}")
MIXTRAL = DEFAULT_CALIBRATIONS["mixtral"]
UNIFORM = RouterCalibration("uniform", (0.0,), (0.0,), crosslayer_share=0.0, temporal_overlap=None)


def overlap_between(routing, a, b):
    """Mean share of top-r experts node a[i] has in common with node b[i], over layers."""
    return sum(float((e[a][:, :, None] == e[b][:, None, :]).any(-1).float().mean()) for e in routing) / len(routing)


@needs_data
def test_generated_counts_match_the_recorded_routing():
    cal = calibrate(SHARED_DATA)
    assert cal.popularity_gini == pytest.approx(DEFAULT_CALIBRATIONS["olmoe"].popularity_gini, abs=1e-3)
    assert cal.crosslayer_share == pytest.approx(DEFAULT_CALIBRATIONS["olmoe"].crosslayer_share, abs=0.01)
    routing = SyntheticRouter(64, 8, 16, cal, seed=0).route_sequence(4000)  # OLMoE shape
    for layer, target in zip((0, 7, 15), cal.popularity_gini):
        assert gini(torch.bincount(routing[layer].reshape(-1), minlength=64)) == pytest.approx(target, abs=0.03)
    for (a, b), target in zip(((0, 7), (7, 15)), cal.data_crosslayer_mi):
        mi = crosslayer_mutual_information(rank_aligned_joint(routing[a], routing[b], 64).numpy())
        assert mi == pytest.approx(target, rel=0.25)
    mixtral = calibrate(SHARED_DATA / "routing", model="mixtral")
    assert mixtral.popularity_gini == pytest.approx(MIXTRAL.popularity_gini, abs=1e-3)


def test_calibration_falls_back_to_defaults(tmp_path):
    assert calibrate(None) == DEFAULT_CALIBRATIONS["olmoe"]
    assert calibrate(tmp_path / "absent", model="mixtral") == MIXTRAL
    with pytest.raises(ValueError, match="available: olmoe, mixtral"):
        calibrate(None, model="switch")


def test_consecutive_tokens_share_experts_like_mixtral_decode():
    routing = SyntheticRouter(8, 2, 4, seed=0).route_sequence(4000)  # 8 experts: Mixtral's stored fit
    per_layer = [top_r_overlap(e) for e in routing]
    assert all(0.34 <= o <= 0.40 for o in per_layer), per_layer
    independent = SyntheticRouter(8, 2, 4, with_overrides(MIXTRAL, temporal_overlap=None), seed=0)
    assert sum(top_r_overlap(e) for e in independent.route_sequence(4000)) / 4 == pytest.approx(0.25, abs=0.02)
    custom = SyntheticRouter(8, 2, 4, with_overrides(MIXTRAL, temporal_overlap=0.6), seed=0)
    assert sum(top_r_overlap(e) for e in custom.route_sequence(4000)) / 4 == pytest.approx(0.6, abs=0.03)


def test_tree_children_share_experts_with_parent_and_siblings():
    # 200 roots with 3 children each: parents [-1, r, r, r, -1, ...]
    parents = [-1 if i % 4 == 0 else i - i % 4 for i in range(800)]
    child = torch.tensor([i for i in range(800) if i % 4])
    parent = torch.tensor([parents[i] for i in child.tolist()])
    sib_a = torch.tensor([i for i in range(800) if i % 4 == 1])
    independent = with_overrides(MIXTRAL, temporal_overlap=None)
    conditioned = with_overrides(MIXTRAL, tree_parent_overlap=0.5, tree_sibling_overlap=0.6)
    base = SyntheticRouter(8, 2, 4, independent, seed=1).route_tree(parents)
    tree = SyntheticRouter(8, 2, 4, conditioned, seed=1).route_tree(parents)
    assert overlap_between(base, child, parent) == pytest.approx(0.25, abs=0.04)
    assert overlap_between(tree, child, parent) == pytest.approx(0.5, abs=0.05)
    assert overlap_between(tree, sib_a, sib_a + 1) == pytest.approx(0.6, abs=0.05)
    assert overlap_between(tree, sib_a, sib_a + 1) > overlap_between(base, sib_a, sib_a + 1) + 0.2
    default = SyntheticRouter(8, 2, 4, MIXTRAL, seed=1).route_tree(parents)  # parent rate = temporal_overlap
    assert overlap_between(default, child, parent) == pytest.approx(0.37, abs=0.04)
    with pytest.raises(ValueError, match="parents must come first"):
        SyntheticRouter(8, 2, 4, MIXTRAL).route_tree([-1, 2, 0])


def test_deterministic_for_a_seed():
    a, b, c = (SyntheticRouter(16, 2, 3, seed=s) for s in (7, 7, 8))
    parents = [-1, 0, 0, 1, 1, 2]
    for x, y in zip(a.route_sequence(50) + a.route_tree(parents), b.route_sequence(50) + b.route_tree(parents)):
        assert torch.equal(x, y)
    assert not all(torch.equal(x, y) for x, y in zip(a.route_sequence(50), c.route_sequence(50)))
    routing = a.route_sequence(5)
    assert len(routing) == 3 and routing[0].shape == (5, 2) and routing[0].dtype == torch.long
    assert all(len(set(row.tolist())) == 2 for e in routing for row in e)  # r distinct experts per token


def test_distinct_experts_curve_vs_uniform():
    skewed = distinct_experts_curve(SyntheticRouter(64, 8, 4, seed=0), max_tokens=32)
    assert all(s <= u + 0.3 for s, u in zip(skewed.synthetic, skewed.uniform))
    assert skewed.synthetic[-1] < 0.9 * skewed.uniform[-1]
    assert skewed.synthetic[0] == pytest.approx(8.0)  # one token: exactly r experts
    uniform = distinct_experts_curve(SyntheticRouter(64, 8, 4, UNIFORM, seed=0), max_tokens=32, num_sequences=32)
    for s, u in zip(uniform.synthetic, uniform.uniform):
        assert s == pytest.approx(u, rel=0.03)
