"""Cost models and identity-keyed routing shared by the two environments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.cost.drafter_cost import DrafterRoofline, draft_forward_sizes, fit_drafter_cost, load_drafter_spec
from engine.cost.node_router import NodeRouter, child_key
from engine.cost.roofline import RooflineCost, load_hardware, load_model_spec
from engine.runtime.footprint import round_footprint
from env.costs import RooflineCostModel
from env.tables import footprint_of

SPECS = ["qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "gpt_oss_120b", "mixtral_8x7b", "olmoe_1b_7b"]


@pytest.mark.parametrize("hardware", ["h100", "cpu"])
@pytest.mark.parametrize("spec_name", ["qwen3_30b_a3b", "deepseek_v3", "mixtral_8x7b"])
def test_roofline_verify_equals_engine_roofline(hardware, spec_name):
    spec = load_model_spec(spec_name)
    ours = RooflineCostModel(hardware, spec, f"{spec_name}_eagle3")
    ref = RooflineCost(load_hardware(hardware), spec)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 33, 400):
        ids = [
            torch.rand(n, spec.num_experts, generator=g).topk(spec.top_r, -1).indices
            for _ in range(spec.num_moe_layers)
        ]
        counts = np.stack([np.bincount(i.reshape(-1).numpy(), minlength=spec.num_experts) for i in ids])
        got = ours.verify(n, int((counts > 0).sum()), 300, counts if ours.needs_counts(n) else None)
        assert got == pytest.approx(ref.forward_cost(ids, 300).total, rel=1e-12)


def test_every_model_spec_has_two_drafter_specs():
    hw = load_hardware("h100")
    for name in SPECS:
        for kind in ("eagle3", "mtp"):
            d = DrafterRoofline(hw, load_drafter_spec(f"{name}_{kind}"))
            costs = [d.round_cost(k, 2, 512) for k in range(0, 9)]
            assert costs[0] == 0.0 and all(b > a for a, b in zip(costs, costs[1:]))
    with pytest.raises(ValueError, match="unknown drafter_spec"):
        load_drafter_spec("gpt5_eagle9")


def test_drafter_fit_recovers_constants():
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(40):
        k, w, a = int(rng.integers(1, 9)), int(rng.integers(1, 5)), bool(rng.integers(2))
        sizes = draft_forward_sizes(k, w, a)
        samples.append((k, w, a, 1e-3 + 2e-4 * len(sizes) + 5e-5 * sum(sizes)))
    fit = fit_drafter_cost(samples)
    assert (fit.fixed, fit.per_forward, fit.per_token) == pytest.approx((1e-3, 2e-4, 5e-5), rel=1e-6)
    assert fit.round_cost(0, 3) == 0.0
    assert fit.threshold_fixed == fit.calibrated_per_token == 0.0  # no scored samples: nothing to identify, held at 0


def test_drafter_fit_prices_each_scoring_rule_apart():
    """Samples of rounds whose rule scored the nodes as they grew (threshold, calibrated) fit their own surplus."""
    rng = np.random.default_rng(1)
    surplus = {"all": (0.0, 0.0), "threshold": (3e-5, 4e-6), "calibrated": (5e-5, 9e-6)}
    samples = []
    for _ in range(90):
        k, w, rule = int(rng.integers(1, 9)), int(rng.integers(1, 4)), str(rng.choice(list(surplus)))
        sizes = draft_forward_sizes(k, w)
        extra = surplus[rule][0] + surplus[rule][1] * sum(sizes)
        samples.append((k, w, False, 1e-4 + 2e-5 * len(sizes) + 1e-6 * sum(sizes) + extra, rule))
    fit = fit_drafter_cost(samples)
    got = (fit.fixed, fit.per_forward, fit.per_token, fit.threshold_fixed, fit.threshold_per_token,
           fit.calibrated_fixed, fit.calibrated_per_token)  # fmt: skip
    assert got == pytest.approx((1e-4, 2e-5, 1e-6, 3e-5, 4e-6, 5e-5, 9e-6), rel=1e-6)
    assert fit.round_cost(4, 2, rule="calibrated") - fit.round_cost(4, 2) == pytest.approx(5e-5 + 9e-6 * 7)
    with pytest.raises(ValueError, match="drafting rule must be one of"):
        fit_drafter_cost([(2, 1, False, 1e-4, "goodput")])


def test_node_router_is_keyed_on_identity():
    router = NodeRouter(64, 8, 6, seed=3)
    root = router.sequence_key([5, 6, 7])
    lat = router.latent([root], None)[0]
    # the same path in two different trees routes identically (siblings never matter)
    ids_a, lat_a, keys_a = router.route_tree(root, lat, [7, 11, 12, 13], [-1, 0, 1, 0])
    ids_b, lat_b, keys_b = router.route_tree(root, lat, [7, 13, 11, 12, 99], [-1, 0, 0, 2, 1])
    assert (
        np.array_equal(ids_a[1], ids_b[2]) and np.array_equal(ids_a[2], ids_b[3]) and np.array_equal(ids_a[3], ids_b[1])
    )
    # a committed token routes like the node it was drafted as
    k = child_key(root, 11)
    assert k == keys_a[1] and np.array_equal(router.route(router.latent([k], lat[None]))[0], ids_a[1])
    # top-r distinct experts per layer; consecutive tokens share experts above chance
    assert all(len(set(row.tolist())) == 8 for row in ids_a.reshape(-1, 8))
    chain = [lat]
    key = root
    for t in range(200):
        key = child_key(key, t)
        chain.append(router.latent([key], chain[-1][None])[0])
    ids = router.route(np.stack(chain))  # [T, L, r]
    overlap = np.mean([len(set(ids[t, l]) & set(ids[t + 1, l])) / 8 for t in range(200) for l in range(6)])
    assert overlap > 8 / 64 + 0.05


def test_footprint_of_is_round_footprint():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (9, 4, 2), generator=g)
    a = footprint_of(ids.numpy(), 16)
    b = round_footprint([ids[:, l] for l in range(4)], 16, None)
    assert (
        a.distinct_experts == b.distinct_experts and a.reuse == b.reuse and a.new_pairs_per_node == b.new_pairs_per_node
    )


def test_node_router_consecutive_tokens_share_the_calibrated_overlap():
    """Cross-layer following must act on the fresh noise (as SyntheticRouter does), not on the latent already
    copied from the parent, or the copy compounds over layers (a Qwen3-30B shape reached 0.81 for 0.37)."""
    from engine.cost.synthetic_router import default_calibration

    router = NodeRouter(128, 8, 48, seed=0)
    target = default_calibration(128).temporal_overlap
    key, lat = router.sequence_key([1, 2, 3]), None
    shares = []
    for t in range(40):
        key = child_key(key, t + 5)
        new = router.latent([key], lat)
        if lat is not None:
            a, b = router.route(lat)[0], router.route(new)[0]  # [L, r]
            shares.append(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a.tolist(), b.tolist())]))
        lat = new
    assert abs(np.mean(shares) - target) < 0.06, np.mean(shares)


def test_prompt_lookup_drafter_spec_prices_host_work_only():
    """The n-gram drafter's spec: no device forward, `host_seconds` per drafting round, 0 at K = 0; `auto` picks it
    for a trace recorded with drafter "ngram" whatever the priced model."""
    from engine.cost.drafter_cost import DrafterSpec
    from env.costs import CostConf, drafter_spec_name

    spec = load_drafter_spec("prompt_lookup")
    assert spec.kind == "lookup" and spec.host_seconds > 0
    d = DrafterRoofline(load_hardware("h200"), spec)
    assert d.round_cost(0, 1, 100) == 0.0
    assert d.round_cost(1, 1, 100) == d.round_cost(8, 3, 4000, expert_aware=True) == spec.host_seconds
    assert drafter_spec_name(CostConf(), "ngram", "qwen3_30b_a3b") == "prompt_lookup"
    assert drafter_spec_name(CostConf(), "eagle-head+expert-predictor", "qwen3_30b_a3b") == "qwen3_30b_a3b_eagle3"
    model = RooflineCostModel("h200", load_model_spec("qwen3_30b_a3b"), "prompt_lookup")
    assert model.draft(4, 2, False, 100) == spec.host_seconds
    with pytest.raises(ValueError, match="host_seconds"):
        DrafterSpec("x", "lookup", 1, 1, 1, 1, 1, 1, 1, host_seconds=-1.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        DrafterSpec("x", "suffix", 1, 1, 1, 1, 1, 1, 1)


def test_the_warm_up_is_fitted_on_whole_live_rounds_and_kept_out_of_the_steady_fits():
    """env.costs.warmup_and_steady: with steady rounds (index >= STEADY_FROM) of both engines, the surcharge of the
    first rounds comes from whole rounds (drafting, forward, host work, probe, choice) and only steady rounds feed the
    other live fits; requests too short for steady rounds fit none and keep every round."""
    from engine.cost.warmup import STEADY_FROM
    from env.costs import warmup_and_steady
    from env.host_calibration import LIVE_ARRAYS

    warm = (5e-4, 2e-4, 1e-4)

    def arrays(length: int) -> dict[str, np.ndarray]:
        rows = []
        for run, plain, n, part in ((0, True, 1, "host"), (1, False, 1, "probe"), (2, False, 4, "draft")):
            for _ in range(4):  # requests
                for i in range(length):
                    extra = warm[i] if i < len(warm) else 0.0
                    rows.append({"run": run, "plain": plain, "verified": n, "round": i, "forward_seconds": 2e-4,
                                 f"{part}_seconds": 1e-4 + extra})  # the surcharge lands in one part or another
        out = {k: np.zeros(len(rows), dtype=d) for k, d in LIVE_ARRAYS.items()}
        for j, r in enumerate(rows):
            for k, v in r.items():
                out[f"cal_live_{k}"][j] = v
        return out

    fit, steady = warmup_and_steady(arrays(STEADY_FROM + 4))
    assert fit.seconds == pytest.approx(warm, rel=1e-5)
    assert steady.sum() == 3 * 4 * 4 and steady.dtype == bool
    fit, steady = warmup_and_steady(arrays(STEADY_FROM))
    assert fit.seconds == () and steady.all()


def test_the_switching_surcharge_is_fitted_on_whole_live_rounds_and_kept_out_of_the_other_fits():
    """env.costs.switch_and_switched / live_fit_rounds: a run that alternates between single-token rounds and
    verifications (a lookup action's cuts and trees) fits both directions from whole rounds, whichever part the
    surcharge lands in, and the rounds that switched leave the other live fits; without switches nothing is left out."""
    from engine.cost.switching import SwitchCost
    from engine.cost.warmup import STEADY_FROM
    from env.costs import live_fit_rounds, switch_and_switched, warmup_and_steady
    from env.host_calibration import LIVE_ARRAYS

    def arrays(switching: bool) -> dict[str, np.ndarray]:
        rows = []
        for run, plain, pattern in ((0, True, [1]), (1, False, [1]), (2, False, [1, 1, 4, 4, 4] if switching else [4])):
            for _ in range(4):  # requests
                for i in range(STEADY_FROM + 24):
                    n, prev = pattern[i % len(pattern)], pattern[(i - 1) % len(pattern)] if i else None
                    extra = 0.0 if prev is None or (prev > 1) == (n > 1) else (3e-5 if n > 1 else 5e-5)
                    rows.append({"run": run, "plain": plain, "verified": n, "round": i, "forward_seconds": 2e-4 * n,
                                 "draft_seconds" if n > 1 else "host_seconds": 1e-4 + extra})  # fmt: skip
        out = {k: np.zeros(len(rows), dtype=d) for k, d in LIVE_ARRAYS.items()}
        for j, r in enumerate(rows):
            for k, v in r.items():
                out[f"cal_live_{k}"][j] = v
        return out

    a = arrays(True)
    fit, switched = switch_and_switched(a)
    assert fit.to_verify == pytest.approx(3e-5, rel=1e-4) and fit.to_single == pytest.approx(5e-5, rel=1e-4)
    assert switched.sum() == 4 * sum(i % 5 in (0, 2) for i in range(1, STEADY_FROM + 24))  # run 2's 1 1 4 4 4 ...
    assert np.array_equal(live_fit_rounds(a), warmup_and_steady(a)[1] & ~switched)
    assert (a["cal_live_run"][switched] == 2).all()
    calm = arrays(False)
    fit, switched = switch_and_switched(calm)
    assert fit == SwitchCost() and not switched.any()
    assert np.array_equal(live_fit_rounds(calm), warmup_and_steady(calm)[1])


def test_the_choice_is_charged_with_the_cooling_it_leaves_a_round():
    """env.costs.bare_k0_rounds / fit_choice: format 11's bare K = 0 run is found by its rounds (none drafted, none
    chose); the choice is the mean of the stand-in's timings, its cooling what its K = 0 rounds' forward and host work
    cost more than the bare run's (medians, >= 0: a spike does not move it), none without the bare run."""
    from engine.cost.warmup import STEADY_FROM
    from env.costs import MIN_STEADY, bare_k0_rounds, fit_choice
    from env.host_calibration import LIVE_ARRAYS

    cool = 6e-6

    def arrays(bare_extra: float) -> dict[str, np.ndarray]:
        rows = []
        for run, plain, steps, policy, extra in ((0, True, 0, 0.0, 0.0), (1, False, 0, 4e-6, cool),
                                                 (2, False, 3, 0.0, 0.0), (3, False, 0, 0.0, bare_extra)):  # fmt: skip
            for i in range(STEADY_FROM + 8):
                spike = 1e-3 if i == STEADY_FROM and run == 3 else 0.0
                rows.append({"run": run, "plain": plain, "verified": 1, "round": i, "draft_steps": steps if i else 0,
                             "policy_seconds": policy, "forward_seconds": 2e-4, "host_seconds": 5e-5 + extra + spike,
                             "context": 100 + i})  # fmt: skip
        a = {k: np.zeros(len(rows), dtype=d) for k, d in LIVE_ARRAYS.items()}
        for j, r in enumerate(rows):
            for k, v in r.items():
                a[f"cal_live_{k}"][j] = v
        return a

    a = arrays(0.0)
    every = np.ones(len(a["cal_live_run"]), dtype=bool)
    bare = bare_k0_rounds(a, every)
    assert np.array_equal(bare, a["cal_live_run"] == 3)  # not run 2, though its first round drafted none
    few = a["cal_live_round"] < MIN_STEADY - 1
    assert not bare_k0_rounds(a, few).any()  # fewer than MIN_STEADY bare rounds among the rows: none
    choice, cooling = fit_choice(a, every, bare)
    assert choice == pytest.approx(4e-6) and cooling == pytest.approx(cool, rel=1e-6)
    b = arrays(2 * cool)
    assert fit_choice(b, every, bare_k0_rounds(b, every))[1] == 0.0  # never negative
    other = a["cal_live_run"] != 3
    assert fit_choice(a, other, bare_k0_rounds(a, other)) == (pytest.approx(4e-6), 0.0)  # no bare run: no cooling
    assert fit_choice(a, a["cal_live_run"] != 1, bare) == (None, 0.0)
