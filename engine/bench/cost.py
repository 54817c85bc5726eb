"""`python -m engine.bench cost`: what one verification forward costs, measured here and modelled on GPUs.

    python -m engine.bench cost                                   # full report (~3-5 min on 2 shared cores)
    python -m engine.bench cost cost.profile=true                 # + torch.profiler Chrome trace
    python -m engine.bench cost cost.sizes=[1,2] cost.specs=[olmoe_1b_7b] cost.max_tree=8   # smoke

Three parts (DESIGN §2 "Cost models", §5), all in one JSON (`bench.out`, default bench_cost.json) and
PNGs next to it (`engine/bench/plots.py`); part 1's forwards are measured by `engine/bench/cost_measure.py`,
parts 1-2 are run here, part 3 lives in `engine/bench/what_if.py`:

1. measured: target forwards over n verified tokens (a random chain or tree of real text after a real
   prompt), per-phase seconds (PhaseTimer), medians over repeats. T_AR, the n = 1 forward, is measured
   right before every T(n) at the same context, so T(n)/T(1) survives drift. With one intra-op thread
   the clock is the thread's CPU time (`time.thread_time`): on a shared machine, wall time also counts
   whatever the scheduler gave to other processes (`cost.clock=wall` to see it).
2. fit: `engine.cost.fit_cost_model` on (routing, context, seconds) samples from real forwards over
   n x context x draft shape ("repeat" drafts reuse one token so Σ_l U_l varies at fixed n), once for
   n = 1 (the engine's single-token decode path, a different code path) and once for n >= 2
   (`DecodeVerifyCost`); R² on held-out samples next to the R² that timing noise alone allows, the
   constants, per-phase measured vs fitted, and the `cpu` hardware profile's roofline on the same forwards.
3. what-if: per model spec (conf/model_spec) and hardware (H200, H100), T(n) for a chain of n = 1..64
   verified tokens under uniform routing and under the calibrated synthetic router (routing record from
   `cost.shared_data`, else the stored fit), T(n)/T_AR, and the utility of a chain with per-depth
   acceptance α, U(n) = E[committed | n] · T_AR / T(n), E[committed | n] = (1 − α^n)/(1 − α)
   (Leviathan et al. 2211.17192, K = n − 1 drafts); the largest n with U > 1; the same under expert
   parallelism over one 8-GPU node (contiguous placement) with its rank imbalance.

Shape letters: n=verified tokens c=context r=top-r L=MoE layers E=experts S=samples.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.bench.configs import PHASE_GROUPS, ROOFLINE_OF_GROUP, CostBenchConfig
from engine.bench.cost_measure import (
    Forward,
    ForwardRunner,
    load_target,
    measure_samples,
    measure_sizes,
    text_stream,
)
from engine.bench.what_if import print_what_if, what_if
from engine.cost.fitted import CostSample, DecodeVerifyCost, _constants, fit_cost_model, fit_two_regimes, r_squared
from engine.cost.roofline import RooflineCost, load_hardware, model_spec_from_hf_config
from engine.cost.utility import expected_committed as expected_committed
from engine.cost.utility import utility_threshold as utility_threshold
from engine.models.transformer import Model

# ---------------------------------------------------------------------------------------------- fit


def fit_report(
    samples: Sequence[Forward],
    roofline: RooflineCost,
    holdout: float,
    seed: int,
) -> tuple[dict, DecodeVerifyCost]:
    """Fit on (1 − holdout) of the samples, R² on the rest, for one linear model over all n and for the
    two-regime model (reported as "fitted"); per-phase two-regime fits; the roofline on every sample."""
    idx = list(range(len(samples)))
    random.Random(seed).shuffle(idx)
    n_test = int(round(holdout * len(idx))) if len(idx) >= 10 else 0
    held = set(idx[:n_test])
    test = [f for i, f in enumerate(samples) if i in held]
    train = [f for i, f in enumerate(samples) if i not in held]

    def r2(model, get, fs) -> float | None:
        return r_squared([model(f.routing, f.context) for f in fs], [get(f) for f in fs]) if fs else None

    def fit(get) -> tuple[DecodeVerifyCost, float | None, float | None]:
        model = fit_two_regimes([CostSample(f.routing, f.context, get(f)) for f in train])
        return model, r2(model, get, train), r2(model, get, test)

    total = lambda f: f.seconds
    single, _ = fit_cost_model([CostSample(f.routing, f.context, f.seconds) for f in train])
    model, r2_train, r2_test = fit(total)
    verify_test = [f for f in test if f.n > 1]
    phases = {g: fit(lambda f, g=g: f.group(g)) for g in PHASE_GROUPS}
    roof_total = [roofline(f.routing, f.context) for f in samples]
    measured = [f.seconds for f in samples]
    # the median of k timings with spread s varies by about s²·π/(2k): the R² that noise alone leaves
    noise = float(np.mean([math.pi / 2 * f.spread**2 / f.repeats for f in samples]))
    ceiling = 1.0 - noise / float(np.var(measured)) if np.var(measured) > 0 else None
    scale = float(np.median(np.array(measured) / np.array(roof_total)))
    table = []
    for n in sorted({f.n for f in samples}):  # per n: medians over contexts x shapes x windows
        fw = [f for f in samples if f.n == n]
        bd = [roofline.forward_cost(f.routing, f.context).as_dict() for f in fw]
        row: dict[str, Any] = {"tokens": n, "samples": len(fw)}
        for g, (pm, _, _) in phases.items():
            row[g] = dict(
                measured=statistics.median(f.group(g) for f in fw),
                fitted=statistics.median(pm(f.routing, f.context) for f in fw),
                roofline=statistics.median(sum(b[p] for p in ROOFLINE_OF_GROUP[g]) for b in bd),
            )
        row["total"] = dict(
            measured=statistics.median(f.seconds for f in fw),
            fitted=statistics.median(model(f.routing, f.context) for f in fw),
            roofline=statistics.median(b["total"] for b in bd),
        )
        table.append(row)
    per_expert = model.verify.per_active_expert
    report = dict(
        samples=len(samples),
        train=len(train),
        heldout=len(test),
        constants=dict(decode=_constants(model.decode), verify=_constants(model.verify)),
        fitted=dict(decode=list(model.decode.fitted), verify=list(model.verify.fitted)),
        r2_train=r2_train,
        r2_heldout=r2_test,
        r2_heldout_verify=r2(model, total, verify_test),
        r2_noise_ceiling=ceiling,
        timing_spread=float(np.median([f.spread / f.seconds for f in samples if f.seconds > 0])),
        single_model=dict(
            constants=_constants(single),
            r2_train=r2(single, total, train),
            r2_heldout=r2(single, total, test),
            decode_over_measured=statistics.median(
                single(f.routing, f.context) / f.seconds for f in samples if f.n == 1
            )
            if any(f.n == 1 for f in samples)
            else None,
        ),
        phase_fits={
            g: dict(constants=_constants(m.verify), r2_train=a, r2_heldout=b) for g, (m, a, b) in phases.items()
        },
        effective_expert_bandwidth=roofline.spec.expert_bytes / per_expert if per_expert > 0 else None,
        expert_bytes=roofline.spec.expert_bytes,
        roofline_cpu=dict(
            r2=r_squared(roof_total, measured),
            median_measured_over_roofline=scale,
            r2_scaled=r_squared([scale * t for t in roof_total], measured),
        ),
        phase_table=table,
        points=[
            dict(
                tokens=f.n,
                context=f.context,
                shape=f.shape,
                distinct=sum(int(e.unique().numel()) for e in f.routing),
                measured=f.seconds,
                fitted=model(f.routing, f.context),
                roofline=r,
                heldout=i in held,
            )
            for i, (f, r) in enumerate(zip(samples, roof_total))
        ],
    )
    return report, model


# ---------------------------------------------------------------------------------------------- entry
def bench_cost(cfg: Any) -> dict:
    """Run the three parts (see the module docstring) and return a JSON-ready dict.

    cfg: a BenchConfig (target, workload, prompts, num_prompts, threads, out); its `cost` field, if any,
    is a CostBenchConfig (defaults otherwise).
    """
    import matplotlib

    from engine.bench.plots import plot_measured, plot_what_if  # lazy: it imports this module

    c: CostBenchConfig = getattr(cfg, "cost", None) or CostBenchConfig()
    if isinstance(c, dict):
        c = CostBenchConfig(**c)
    threads = int(getattr(cfg, "threads", 1) or 1)
    clock = c.clock if c.clock != "auto" else ("cpu" if threads == 1 else "wall")
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = random.Random(c.seed)
    res: dict[str, Any] = dict(config=asdict(c), threads=threads, clock=clock, torch=torch.__version__)
    try:
        model, source = load_target(getattr(cfg, "target", None))
        model.eval()
        max_ctx = max([c.context, *c.fit_contexts])
        max_nodes = max([*c.sizes, *c.fit_sizes])
        stream = text_stream(
            model,
            getattr(cfg, "workload", "mixed"),
            getattr(cfg, "prompts", None),
            getattr(cfg, "num_prompts", 8),
            (max_ctx + max_nodes + 1) * c.windows,
        )
        runner = ForwardRunner(model, stream, c.windows, max_ctx, max_nodes, clock)
        for _ in range(5):  # warm-up (allocator, lazily fused weights)
            runner.forward(0, c.context, runner.draft(0, c.context, max_nodes, "chain", gen))
            runner.forward(0, c.context, runner.draft(0, c.context, 1, "chain", gen))
        res["target"] = dict(
            source=source,
            config={k: v for k, v in model.config.raw.items() if k != "architectures"},
            parameters=sum(p.numel() for p in model.parameters()),
            dtype=str(model.dtype),
        )
        rows, size_forwards, ar_forwards = measure_sizes(runner, c, gen)
        res["measured"] = dict(context=c.context, t_ar=statistics.median(r["t_ar"] for r in rows), sizes=rows)
        samples = measure_samples(runner, c, gen)
        spec = model_spec_from_hf_config(model.config.raw, name="target", weight_bytes=model.dtype.itemsize)
        roofline = RooflineCost(load_hardware("cpu"), spec)
        res["fit"], fitted = fit_report(samples, roofline, c.holdout, c.seed)
        for name, cost in (("fitted", fitted), ("roofline", roofline)):  # the models on the same forwards
            ar = statistics.median(cost(f.routing, f.context) for f in ar_forwards)
            for row, fw in zip(rows, size_forwards):
                row[f"{name}_ratio"] = statistics.median(cost(f.routing, f.context) for f in fw) / ar
        res["fit"]["roofline_spec"] = asdict(spec)
        if c.profile:
            res["profile"] = _profile(model, runner, fitted, c, cfg)
    finally:
        torch.set_num_threads(prev_threads)
    res["what_if"] = [what_if(s, c) for s in c.specs]
    if c.plot:
        matplotlib.use("Agg")
        out = Path(getattr(cfg, "out", None) or "bench_cost.json")
        folder = Path(c.plot_dir) if c.plot_dir else out.parent
        folder.mkdir(parents=True, exist_ok=True)
        stem = out.stem
        plots = dict(
            measured=folder / f"{stem}_measured.png",
            ratio=folder / f"{stem}_tree_cost.png",
            distinct=folder / f"{stem}_distinct_experts.png",
        )
        plot_measured(res, plots["measured"])
        if res["what_if"]:
            plot_what_if(res, c, plots["ratio"], plots["distinct"])
        res["plots"] = {k: str(v) for k, v in plots.items() if v.exists()}
    return res


def _profile(model: Model, runner: ForwardRunner, fitted: DecodeVerifyCost, c: CostBenchConfig, cfg: Any) -> dict:
    """Chrome trace of a few Engine rounds (n-gram drafter, K=4, W=2) with the fitted model attached."""
    from engine.cost.profiling import chrome_trace
    from engine.runtime.engine import Engine
    from engine.spec.config import SpecConfig

    eng = Engine(model, drafter="ngram", cost_model=fitted)
    prompts = [t[: c.context].tolist() for t in runner.texts]
    path = c.profile_path or str(Path(getattr(cfg, "out", None) or "bench_cost.json").with_suffix("")) + "_trace.json"
    rounds = []

    def step(i: int) -> None:
        res = eng.generate([prompts[i % len(prompts)]], c.profile_tokens, spec=SpecConfig(depth=4, width=2))
        if i >= 0:
            rounds.extend(res[0].rounds)

    summary = chrome_trace(step, path, steps=c.profile_steps, label="generate")
    return dict(
        path=summary.path,
        steps=summary.steps,
        rounds=len(rounds),
        top_ops=[asdict(r) for r in summary.top_ops],
        rounds_forward_wall=[r.time.get("forward", 0.0) for r in rounds],
        rounds_modelled=[r.modelled_seconds for r in rounds],
        rounds_verified=[r.verified_tokens for r in rounds],
    )


# ---------------------------------------------------------------------------------------------- print
def _ms(x: float | None) -> str:
    return "   n/a" if x is None else f"{x * 1e3:6.3f}"


def print_cost(res: dict) -> None:
    """Tables of the three parts (entry point only: the library returns `res`)."""
    t, m = res["target"], res["measured"]
    print(f"\n== 1. measured target forwards on this CPU ({res['threads']} thread(s), {res['clock']} clock) ==")
    print(
        f"target: {t['source']} ({t['parameters'] / 1e6:.2f} M params, {t['dtype']}); context {m['context']} "
        f"tokens; T_AR (n=1) = {m['t_ar'] * 1e3:.3f} ms\n"
        "T(n): the forward the engine runs; phases (ms): the same forward on the per-op path, timed phase by phase"
    )
    keys = ["embed", "attention", "router", "experts", "combine", "lm_head", "other"]
    print(
        f"{'n':>3} {'T(n) ms':>8} {'T(n)/T(1)':>9} {'fitted':>6} {'roofl.':>6} {'ΣU_l':>5} "
        + " ".join(f"{k:>9}" for k in keys)
    )
    for r in m["sizes"]:
        print(
            f"{r['tokens']:>3} {r['seconds'] * 1e3:>8.3f} {r['ratio']:>9.2f} "
            f"{r.get('fitted_ratio', 0):>6.2f} {r.get('roofline_ratio', 0):>6.2f} "
            f"{r['distinct_experts']:>5.0f} " + " ".join(f"{r['phases'].get(k, 0.0) * 1e3:>9.3f}" for k in keys)
        )
    f = res["fit"]
    print("\n== 2. fitted cost model: s = fixed + per_token·n + per_active_expert·Σ_l U_l + per_layer_context·L·c"
          " + per_query_context·n·L·c ==")  # fmt: skip
    print(
        f"{f['samples']} samples ({f['train']} fit, {f['heldout']} held out); two regimes: n = 1 "
        "(decode fast path) and n >= 2 (verification)"
    )
    for regime in ("decode", "verify"):
        k = f["constants"][regime]
        print(
            f"  {regime:<6}: fixed {k['fixed'] * 1e6:8.1f} µs, per_token {k['per_token'] * 1e6:6.2f} µs, "
            f"per_active_expert {k['per_active_expert'] * 1e6:6.2f} µs, per_layer_context "
            f"{k['per_layer_context'] * 1e9:6.2f} ns, per_query_context {k['per_query_context'] * 1e9:6.3f} ns  "
            f"(fitted: {', '.join(f['fitted'][regime])})"
        )
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"
    sm = f["single_model"]
    print(
        f"R² fit {fmt(f['r2_train'])}, held out {fmt(f['r2_heldout'])} (n >= 2 only: "
        f"{fmt(f['r2_heldout_verify'])}); one linear model for all n: held out {fmt(sm['r2_heldout'])}, "
        f"its T_AR / measured = {fmt(sm['decode_over_measured'])}"
    )
    if f.get("r2_noise_ceiling") is not None:
        print(
            f"timing noise: median spread {f['timing_spread'] * 100:.1f}% of a sample's seconds over its repeats; "
            f"R² a perfect model could reach on these medians ≈ {f['r2_noise_ceiling']:.4f}"
        )
    if f["effective_expert_bandwidth"]:
        print(
            f"effective expert bandwidth {f['effective_expert_bandwidth'] / 1e9:.2f} GB/s "
            f"({f['expert_bytes'] / 1e3:.0f} kB per expert / verify per_active_expert)"
        )
    rc = f["roofline_cpu"]
    print(
        f"'cpu' roofline profile on the same forwards: R² {rc['r2']:.3f}; measured/roofline median "
        f"{rc['median_measured_over_roofline']:.2f}x (R² after that scale {rc['r2_scaled']:.3f})"
    )
    pf = f["phase_fits"]
    print(
        "per-phase fits (held-out R²): "
        + ", ".join(
            f"{g} {'n/a' if v['r2_heldout'] is None else format(v['r2_heldout'], '.3f')}" for g, v in pf.items()
        )
    )
    print("\nper n, medians over the fit samples (contexts x draft shapes x windows):")
    print(f"{'n':>3} " + " ".join(f"{g + ' meas/fit/roof ms':>28}" for g in [*PHASE_GROUPS, "total"]))
    for row in f["phase_table"]:
        cells = [
            f"{_ms(row[g]['measured'])}/{_ms(row[g]['fitted'])}/{_ms(row[g]['roofline'])}"
            for g in [*PHASE_GROUPS, "total"]
        ]
        print(f"{row['tokens']:>3} " + " ".join(f"{x:>28}" for x in cells))
    if "profile" in res:
        p = res["profile"]
        print(f"\nprofile: {p['rounds']} engine rounds in {p['steps']} generate calls -> {p['path']}")
        for op in p["top_ops"][:8]:
            print(f"  {op['name'][:40]:<40} {op['calls']:>6} calls {op['self_ms']:>9.2f} ms self")
    print_what_if(res)
    for k, v in res.get("plots", {}).items():
        print(f"plot {k}: {v}")
