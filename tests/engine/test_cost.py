"""Roofline known answers, monotonicity, EP slowest rank, config errors, and the least-squares fit."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from engine.cost.fitted import CONSTANTS, CostSample, cost_features, fit_cost_model
from engine.cost.roofline import (
    CONF_DIR,
    HardwareProfile,
    ModelSpec,
    RooflineCost,
    load_hardware,
    load_model_spec,
    model_spec_from_hf_config,
)
from engine.cost.utility import expected_distinct_experts
from engine.parallel.placement import place_experts

HW = HardwareProfile(
    name="toy",
    hbm_bandwidth=1e12,
    peak_flops_bf16=1e14,
    peak_flops_fp8=2e14,
    nvlink_bandwidth=1e11,
    nvlink_latency=1e-6,
    internode_bandwidth=1e10,
    internode_latency=1e-5,
    pcie_bandwidth=1e10,
    pcie_latency=2e-6,
    launch_overhead=0.0,
)
SPEC = ModelSpec(
    name="toy",
    num_layers=1,
    num_dense_layers=0,
    hidden_size=1000,
    expert_dim=2000,
    num_experts=4,
    top_r=1,
    num_shared_experts=0,
    shared_expert_dim=0,
    dense_ffn_dim=0,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=100,
    expert_weight_bytes=2.0,
    dense_weight_bytes=2.0,
)
D, F = SPEC.hidden_size, SPEC.expert_dim


def ids(*rows):
    return torch.tensor(rows, dtype=torch.long)


def test_one_expert_one_token_memory_bound():
    cost = RooflineCost(HW, SPEC).forward_cost([ids([0])], context_len=0)
    expert_bytes = 3 * D * F * 2  # gate, up, down in bf16
    assert cost.expert_gemm == pytest.approx(expert_bytes / HW.hbm_bandwidth)  # 12 µs >> 6DF/peak = 0.12 µs
    router = max(D * 4 * 2 / HW.hbm_bandwidth, 2 * D * 4 / HW.peak_flops_bf16)
    assert cost.router == pytest.approx(router)
    attn_params = 2 * D * 8 * 64 + 2 * D * 2 * 64
    kv = 2 * 2 * 64 * 2  # k and v, 2 kv heads, head_dim 64, bf16, for the one new token
    assert cost.attention == pytest.approx((attn_params * 2 + kv) / HW.hbm_bandwidth)
    assert cost.dispatch == cost.combine == 0.0
    assert cost.total == pytest.approx(sum(cost.per_layer) + 100 * D * 2 / HW.hbm_bandwidth)


def test_one_expert_compute_bound():
    hw = dataclasses.replace(HW, peak_flops_bf16=1e13)
    n = 1000  # all tokens on expert 0: 6·D·F·n flops / peak = 1.2 ms > 12 µs of weight reads
    cost = RooflineCost(hw, SPEC).forward_cost([torch.zeros(n, 1, dtype=torch.long)], context_len=0)
    assert cost.expert_gemm == pytest.approx(6 * D * F * n / hw.peak_flops_bf16)
    fp8 = dataclasses.replace(SPEC, compute_dtype="fp8", expert_weight_bytes=1.0)
    cost8 = RooflineCost(hw, fp8).forward_cost([torch.zeros(n, 1, dtype=torch.long)], context_len=0)
    assert cost8.expert_gemm == pytest.approx(6 * D * F * n / hw.peak_flops_fp8)


def test_more_distinct_experts_never_cost_less():
    rng = random.Random(0)
    spec = dataclasses.replace(SPEC, num_layers=3, num_experts=16, top_r=2)
    ep = place_experts(16, 4, "contiguous", ranks_per_node=2)
    for hw in (HW, dataclasses.replace(HW, peak_flops_bf16=3e11)):  # memory- and compute-bound regimes
        plain, with_ep = RooflineCost(hw, spec), RooflineCost(hw, spec, layout=ep)
        for _ in range(40):
            n = rng.randint(1, 12)
            routing = [torch.stack([torch.randperm(16)[:2] for _ in range(n)]) for _ in range(3)]
            # adding a token adds assignments: cost cannot drop, with or without EP
            extra = [torch.cat([e, torch.randperm(16)[:2][None]]) for e in routing]
            for model in (plain, with_ep):
                assert model(extra, 64) >= model(routing, 64) - 1e-15
            # moving one assignment onto an inactive expert: more distinct experts, same tokens
            layer = rng.randrange(3)
            inactive = sorted(set(range(16)) - set(routing[layer].reshape(-1).tolist()))
            moved = [e.clone() for e in routing]
            t = rng.randrange(n)
            k = rng.randrange(2)
            if inactive and moved[layer][t, 1 - k] != inactive[0]:
                moved[layer][t, k] = inactive[0]
                assert plain(moved, 64) >= plain(routing, 64) - 1e-15


def test_ep_layer_time_is_slowest_rank():
    spec = dataclasses.replace(SPEC, top_r=2)
    placement = place_experts(4, 2, "contiguous", ranks_per_node=2)  # rank 0: {0, 1}, rank 1: {2, 3}
    routing = [ids([0, 2], [0, 3], [0, 2])]  # rank 0 runs 1 expert, rank 1 runs 2
    t_mem = 3 * D * F * 2 / HW.hbm_bandwidth
    plain = RooflineCost(HW, spec).forward_cost(routing, 0)
    ep = RooflineCost(HW, spec, layout=placement).forward_cost(routing, 0)
    assert plain.expert_gemm == pytest.approx(3 * t_mem)
    assert ep.expert_gemm == pytest.approx(2 * t_mem)
    # all tokens on rank 0: each goes once to rank 1 over NVLink (3 tokens x D x 2 bytes) + latency
    assert ep.dispatch == pytest.approx(3 * D * 2 / HW.nvlink_bandwidth + HW.nvlink_latency)
    assert ep.combine == ep.dispatch
    # two nodes of one rank each: the same bytes cross InfiniBand instead
    ep2 = RooflineCost(HW, spec, layout=place_experts(4, 2, "contiguous", ranks_per_node=1)).forward_cost(routing, 0)
    assert ep2.dispatch == pytest.approx(3 * D * 2 / HW.internode_bandwidth + HW.internode_latency)


def test_expected_cost_matches_uniform_formula_and_decode():
    spec = dataclasses.replace(SPEC, num_layers=2, num_experts=16, top_r=2)
    model = RooflineCost(HW, spec)
    t_mem = 3 * D * F * 2 / HW.hbm_bandwidth
    base = model.forward_cost([torch.zeros(5, 0, dtype=torch.long)] * 2, 32)
    exp = model.expected_cost(5, 32)
    assert exp.expert_gemm - base.expert_gemm == pytest.approx(2 * expected_distinct_experts(16, 2, 5) * t_mem)
    # one token always touches exactly r experts per layer
    one = model.forward_cost([ids([3, 7]), ids([0, 1])], 32)
    assert model.decode_cost(32).total == pytest.approx(one.total)
    assert expected_distinct_experts(16, 2, 1) == pytest.approx(2.0)
    ep = RooflineCost(HW, spec, layout=place_experts(16, 2, "round_robin"))
    assert ep.expected_cost(5, 32, num_samples=4).total > 0


def test_shipped_profiles_and_specs_load():
    for name in ("h100", "h200", "a100", "rtx6000ada", "cpu"):
        hw = load_hardware(name)
        assert hw.hbm_bandwidth > 0 and hw.peak_flops_bf16 > 0
    assert load_hardware("rtx6000ada").intra_node_link() == (32e9, 5e-6)  # no NVLink: PCIe
    total_params = {
        "deepseek_v3": 671e9,
        "qwen3_235b_a22b": 235e9,
        "qwen3_30b_a3b": 30.5e9,
        "gpt_oss_120b": 117e9,
        "mixtral_8x7b": 46.7e9,
        "olmoe_1b_7b": 6.9e9,
    }
    for name, expected in total_params.items():
        s = load_model_spec(name)
        params = (
            s.num_moe_layers * s.num_experts * 3 * s.hidden_size * s.expert_dim
            + s.num_moe_layers * 3 * s.hidden_size * s.shared_expert_dim * s.num_shared_experts
            + s.num_dense_layers * 3 * s.hidden_size * s.dense_ffn_dim
            + s.num_layers * s.attn_params
            + 2 * s.vocab_size * s.hidden_size
        )
        assert params == pytest.approx(expected, rel=0.03), name
    assert RooflineCost(load_hardware("h100"), load_model_spec("deepseek_v3")).decode_cost(1024).total > 0


def test_missing_field_and_unknown_name(tmp_path):
    text = (CONF_DIR / "hardware" / "h100.yaml").read_text()
    broken = tmp_path / "broken.yaml"
    broken.write_text("\n".join(line for line in text.splitlines() if not line.startswith("hbm_bandwidth")))
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        load_hardware(broken)
    broken.write_text(text + "\nhbm_bandwith: 3.0e12\n")  # a misspelt extra key is not silently ignored
    with pytest.raises(ValueError, match=r"hbm_bandwith.*HardwareProfile"):
        load_hardware(broken)
    broken.write_text(text.replace("gpus_per_node: 8", "gpus_per_node: eight"))
    with pytest.raises(ValueError, match=r"(?s)eight.*gpus_per_node"):
        load_hardware(broken)
    with pytest.raises(ValueError, match=r"available: .*a100.*h100"):
        load_hardware("h900")
    with pytest.raises(ValueError, match="mixtral_8x7b"):
        load_model_spec("mixtral")


def test_spec_from_hf_config():
    cfg = {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "intermediate_size": 512,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "shared_expert_intermediate_size": 256,
    }
    s = model_spec_from_hf_config(cfg, "tiny", weight_bytes=4.0)
    assert (s.num_moe_layers, s.head_dim, s.num_shared_experts, s.expert_bytes) == (
        4,
        64,
        1,
        3 * 256 * 128 * 4,
    )


def test_fit_recovers_known_constants():
    gen = torch.Generator().manual_seed(0)
    truth = np.array([2e-3, 1e-4, 5e-5, 2e-8, 3e-9])  # fixed, per token, per active expert, per L·context, n·L·context
    samples = []
    for i in range(60):
        n = 1 + i % 16
        routing = [torch.rand(n, 16, generator=gen).topk(2, -1).indices for _ in range(4)]
        ctx = int(torch.randint(1, 2000, (1,), generator=gen))
        seconds = float(np.dot(truth, cost_features(routing, ctx))) * (1 + 1e-3 * float(torch.randn(1, generator=gen)))
        samples.append(CostSample(routing, ctx, seconds))
    fitted, r2 = fit_cost_model(samples)
    assert r2 > 0.99
    got = np.array([getattr(fitted, k) for k in CONSTANTS])
    np.testing.assert_allclose(got, truth, rtol=0.05)
    assert fitted(samples[0].routing, samples[0].context_len) == pytest.approx(samples[0].seconds, rel=0.01)
    # constant context cannot be told apart from the fixed cost: held at 0, not fitted
    same_ctx = [CostSample(s.routing, 100, s.seconds) for s in samples]
    assert "per_layer_context" not in fit_cost_model(same_ctx)[0].fitted
    # one n for every sample: n·L·context is a multiple of L·context, so it is not identifiable either
    one_n = [s for s in samples if s.routing[0].shape[0] == 1]
    assert fit_cost_model(one_n * 3)[0].fitted == ("fixed", "per_layer_context")  # Σ_l U_l = L·r at n = 1 too


def test_fit_never_prices_a_forward_below_zero():
    """Timings whose unconstrained least squares has a negative fixed cost (cost falling with more tokens at small
    n, as a few noisy samples on a loaded machine can give): every constant stays >= 0, the one held at 0 leaves
    `fitted`, and the constrained fit equals nonnegative_lstsq's exhaustive check over column subsets."""
    from itertools import combinations

    from engine.cost.fitted import nonnegative_lstsq

    gen = torch.Generator().manual_seed(1)
    samples = []
    for n in (2, 3, 4, 6, 8, 12, 16) * 2:
        routing = [torch.rand(n, 16, generator=gen).topk(2, -1).indices for _ in range(4)]
        samples.append(CostSample(routing, 50, 1e-4 * n - 2e-4 + 1e-5 * float(torch.rand(1, generator=gen))))
    X = np.array([cost_features(s.routing, s.context_len) for s in samples])
    y = np.array([s.seconds for s in samples])
    assert np.linalg.lstsq(X[:, :3], y, rcond=None)[0].min() < 0  # the unconstrained fit goes negative
    fitted, _ = fit_cost_model(samples)
    assert all(getattr(fitted, k) >= 0 for k in CONSTANTS)
    assert "fixed" not in fitted.fitted
    assert min(fitted.seconds(n, 8.0, 4, 50) for n in range(1, 17)) > 0
    # the optimum over every non-negative subset fit (what NNLS finds)
    got = nonnegative_lstsq(X, y, [0, 1, 2])
    res = float(np.sum((X[:, list(got)] @ np.array(list(got.values())) - y) ** 2))
    subset_res = []
    for r in (1, 2, 3):
        for c in combinations(range(3), r):
            coef = np.linalg.lstsq(X[:, list(c)], y, rcond=None)[0]
            if coef.min() >= 0:
                subset_res.append(float(np.sum((X[:, list(c)] @ coef - y) ** 2)))
    assert res == pytest.approx(min(subset_res), rel=1e-12)


def test_robust_fit_sets_no_slope_from_spikes_late_in_requests():
    """Single-token forwards whose cost does not grow with context (0.5 ms ± 2 %), and 4 % of them spiking to 2 ms,
    all at long contexts (what a shared machine did to a recording's target-only steps late in each request):
    least squares prices a long-context step ~25 % dearer than a short one; the robust fit finds no slope to speak of,
    and its mean over the samples stays the measured mean (the spikes charged to every step alike). Without spikes
    both fits agree."""
    from engine.cost.fitted import fit_cost_model_robust

    rng = np.random.default_rng(0)
    routing = [torch.tensor([[0, 1]])] * 4  # one token, L = 4 layers
    ctx = rng.integers(20, 200, 1000)
    seconds = 5e-4 * (1 + 0.02 * rng.standard_normal(1000))
    late = np.flatnonzero(ctx > 150)
    seconds[rng.choice(late, 40, replace=False)] = 2e-3
    samples = [CostSample(routing, int(c), float(s)) for c, s in zip(ctx, seconds)]
    ols, _ = fit_cost_model(samples)
    robust, _ = fit_cost_model_robust(samples)
    assert ols.seconds(1, 8, 4, 190) > 1.2 * ols.seconds(1, 8, 4, 30)  # the artefact
    assert robust.seconds(1, 8, 4, 190) < 1.02 * robust.seconds(1, 8, 4, 30)
    mean = np.mean([robust(s.routing, s.context_len) for s in samples])
    assert mean == pytest.approx(seconds.mean(), rel=1e-9)
    clean = [CostSample(routing, int(c), float(5e-4 + 1e-7 * c)) for c in ctx]  # a real slope, no spikes
    a, b = fit_cost_model(clean)[0], fit_cost_model_robust(clean)[0]
    assert b.per_layer_context == pytest.approx(a.per_layer_context, rel=1e-6) and b.fixed == pytest.approx(a.fixed)
