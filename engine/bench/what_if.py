"""Part 3 of `python -m engine.bench cost`: what verifying a tree of n tokens would cost on GPUs.

    python -m engine.bench cost cost.sizes=[1,2] cost.specs=[olmoe_1b_7b] cost.max_tree=8   # smoke
    python -m engine.bench cost cost.specs=[deepseek_v3,mixtral_8x7b] cost.hardware=[h200]

Per model spec (conf/model_spec) and hardware (H200, H100): the roofline T(n) (`engine.cost.RooflineCost`)
of a chain of n = 1..max_tree verified tokens under uniform routing and under the calibrated synthetic
router (routing record from `cost.shared_data`, else the stored fit), T(n)/T_AR, and the utility of a
chain with per-depth acceptance α, U(n) = E[committed | n] · T_AR / T(n), E[committed | n] = (1 − α^n)/(1 − α)
(Leviathan et al. 2211.17192, K = n − 1 drafts); the largest n with U > 1; the same under expert
parallelism over one 8-GPU node (contiguous placement) with its rank imbalance. `engine/bench_cost.py`
runs it after the measured parts; `print_what_if` is its table.

Shape letters: n=verified tokens r=top-r L=MoE layers E=experts S=samples T=tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.cost.roofline import RooflineCost, load_hardware, load_model_spec
from engine.cost.synthetic_router import distinct_by_prefix
from engine.cost.utility import expected_distinct_experts, utilities, utility_threshold
from engine.parallel.placement import layout_stats, place_experts
from engine.paths import shared_data_dir

if TYPE_CHECKING:  # engine.bench_cost imports this module
    from engine.bench.configs import CostBenchConfig

EP_REPORT_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _routings(spec, kind: str, calibration, max_n: int, samples: int, seed: int) -> list[list[torch.Tensor]]:
    """S routings (each L x [max_n, r]) of a chain; prefixes give every n <= max_n."""
    from engine.cost.synthetic_router import SyntheticRouter

    E, r, L = spec.num_experts, spec.top_r, spec.num_moe_layers
    if kind == "uniform":
        g = torch.Generator().manual_seed(seed)
        return [[torch.rand(max_n, E, generator=g).topk(r, -1).indices for _ in range(L)] for _ in range(samples)]
    return [SyntheticRouter(E, r, L, calibration, seed=seed + s).route_sequence(max_n) for s in range(samples)]


def _prices(cost: RooflineCost, routings, max_n: int, context_len: int) -> np.ndarray:
    """[S, max_n, 2]: (total, expert_gemm) seconds of the chain prefix n = 1..max_n of every routing."""
    out = np.zeros((len(routings), max_n, 2))
    for i, rt in enumerate(routings):
        for n in range(1, max_n + 1):
            b = cost.forward_cost([e[:n] for e in rt], context_len)
            out[i, n - 1] = b.total, b.expert_gemm
    return out


def _curve(seconds: np.ndarray, alphas: Sequence[float], draft_cost: float) -> dict:
    """Mean T(n) over samples (seconds [S, max_n]), T(n)/T_AR, utility thresholds and the best n per α."""
    mean = seconds.mean(0)  # [max_n]
    ratio = (mean / mean[0]).tolist()
    best = {}
    for a in alphas:
        u = utilities(ratio, a, draft_cost)
        best[str(a)] = dict(n=int(np.argmax(u)) + 1, utility=float(max(u)))
    return dict(
        seconds=mean.tolist(),
        t_ar=float(mean[0]),
        ratio=ratio,
        threshold={str(a): utility_threshold(ratio, a, draft_cost) for a in alphas},
        best=best,
    )


def _imbalance(ep: RooflineCost, single: RooflineCost, routings, ep_prices, single_prices, c) -> dict:
    """Rank imbalance of the EP layout and what it costs, at EP_REPORT_SIZES.

    expert_slowdown = slowest rank's expert time / an even split of the same work (shared experts stay
    on the token's rank); imbalance_share = the time above the even split / EP T(n).
    """
    spec, W = ep.spec, ep.layout[0].world_size
    sizes = [n for n in EP_REPORT_SIZES if n <= c.max_tree]
    empty = lambda n: [torch.zeros(n, 0, dtype=torch.long)] * spec.num_moe_layers
    shared = np.array([single.forward_cost(empty(n), c.context_len).expert_gemm for n in sizes])  # [sizes]
    i = np.array(sizes) - 1
    ep_expert, ep_total = ep_prices[:, i, 1], ep_prices[:, i, 0]  # [S, sizes]
    even = shared + (single_prices[: len(routings), i, 1] - shared) / W
    stats = [[layout_stats([e[:n] for e in rt], ep.layout) for rt in routings] for n in sizes]
    return dict(
        tokens=sizes,
        mean=[float(np.mean([s.imbalance_mean for s in row])) for row in stats],
        max=[float(np.mean([s.imbalance_max for s in row])) for row in stats],
        expert_slowdown=(ep_expert / even).mean(0).tolist(),
        imbalance_share=((ep_expert - even) / ep_total).mean(0).tolist(),
    )


def what_if(spec_name: str, c: CostBenchConfig) -> dict:
    """Tree-size cost curves, utility thresholds and the EP variant of one model spec."""
    from engine.cost.synthetic_router import ROUTING_FILE, calibrate

    spec = load_model_spec(spec_name)
    record = "mixtral" if spec.num_experts <= 22 else "olmoe"  # as synthetic_router.default_calibration
    data = shared_data_dir(c.shared_data)
    found = (data / "routing" / ROUTING_FILE).is_file() or (data / ROUTING_FILE).is_file()
    cal = calibrate(data if found else None, record)
    routings = {k: _routings(spec, k, cal, c.max_tree, c.samples, c.seed) for k in ("uniform", "calibrated")}
    out: dict[str, Any] = dict(
        spec=spec_name,
        num_experts=spec.num_experts,
        top_r=spec.top_r,
        moe_layers=spec.num_moe_layers,
        calibration=dict(source=cal.source, record=record, data_found=found, data_dir=str(data)),
        tokens=list(range(1, c.max_tree + 1)),
        hardware={},
        distinct=dict(
            uniform_formula=[
                expected_distinct_experts(spec.num_experts, spec.top_r, t) for t in range(1, c.max_tree + 1)
            ],
            **{k: distinct_by_prefix(v, spec.num_experts) for k, v in routings.items()},
        ),
    )
    for i, hw_name in enumerate(c.hardware):
        hw = load_hardware(hw_name)
        layouts = {"single": RooflineCost(hw, spec)}
        ep_ok = c.ep_world > 1 and (
            spec.num_experts % c.ep_world == 0 or c.ep_placement not in ("contiguous", "round_robin")
        )
        if i == 0 and ep_ok:  # EP variant on the first hardware profile only (it is the slow part)
            placement = place_experts(spec.num_experts, c.ep_world, c.ep_placement, ranks_per_node=hw.gpus_per_node)
            layouts[f"ep{c.ep_world}"] = RooflineCost(hw, spec, placement)
        res: dict[str, dict] = {}
        single_prices = {}
        for name, cost in layouts.items():
            res[name] = {}
            for kind, rts in routings.items():
                rts = rts if name == "single" else rts[: max(c.ep_samples, 1)]
                prices = _prices(cost, rts, c.max_tree, c.context_len)
                res[name][kind] = _curve(prices[..., 0], c.alphas, c.draft_cost)
                if name == "single":
                    single_prices[kind] = prices
                else:
                    res[name][kind]["imbalance"] = _imbalance(
                        cost, layouts["single"], rts, prices, single_prices[kind], c
                    )
        out["hardware"][hw_name] = res
    return out


# ---------------------------------------------------------------------------------------------- print
def print_what_if(res: dict) -> None:
    """Part 3's tables from `bench_cost`'s result (entry point only, via `print_cost`)."""
    print(
        "\n== 3. what-if on GPUs (roofline, chain of n verified tokens, context "
        f"{res['config']['context_len']}, draft cost {res['config']['draft_cost']}·T_AR per draft) =="
    )
    alphas = [str(a) for a in res["config"]["alphas"]]
    mid = alphas[len(alphas) // 2]
    top = res["config"]["max_tree"]
    cap = lambda n: f"{n}+" if n >= top else str(n)  # U > 1 up to the largest n tried
    print("largest n with U > 1 per α (U = E[committed | n]·T_AR/T(n)); best n by U at α = " + mid)
    print(
        f"{'spec':<16} {'hw':<5} {'layout':<6} {'routing':<10} {'T_AR µs':>8} {'T8/AR':>6} {f'T{top}/AR':>7} "
        + " ".join(f"{'α=' + a:>6}" for a in alphas)
        + f" {'best n (U)':>11}"
    )
    for s in res["what_if"]:
        for hw, layouts in s["hardware"].items():
            for lay, kinds in layouts.items():
                for kind, cv in kinds.items():
                    r, b = cv["ratio"], cv["best"][mid]
                    print(
                        f"{s['spec']:<16} {hw:<5} {lay:<6} {kind:<10} {cv['t_ar'] * 1e6:>8.1f} "
                        f"{r[min(8, len(r)) - 1]:>6.2f} {r[-1]:>7.2f} "
                        + " ".join(f"{cap(cv['threshold'][a]):>6}" for a in alphas)
                        + f" {b['n']:>4} ({b['utility']:.2f})"
                    )
        cal = s["calibration"]
        print(
            f"{'':<16} calibration: {cal['source']}"
            + ("" if cal["data_found"] else f" (no routing record under {cal['data_dir']}: stored defaults)")
        )
    ep_rows = [
        (s["spec"], hw, lay, kind, cv["imbalance"])
        for s in res["what_if"]
        for hw, layouts in s["hardware"].items()
        for lay, kinds in layouts.items()
        for kind, cv in kinds.items()
        if "imbalance" in cv
    ]
    if ep_rows:
        sizes = ep_rows[0][4]["tokens"]
        print(
            "\nEP rank imbalance (max/mean assignments per rank, mean over layers) | slowest rank's expert "
            "time / even split | share of T(n) above the even split"
        )
        print(f"{'spec':<16} {'hw':<5} {'layout':<6} {'routing':<10} " + " ".join(f"{f'n={n}':>17}" for n in sizes))
        for spec, hw, lay, kind, imb in ep_rows:
            cells = [
                f"{m:4.2f}|{x:4.2f}|{sh * 100:4.1f}%"
                for m, x, sh in zip(imb["mean"], imb["expert_slowdown"], imb["imbalance_share"])
            ]
            print(f"{spec:<16} {hw:<5} {lay:<6} {kind:<10} " + " ".join(f"{x:>17}" for x in cells))
