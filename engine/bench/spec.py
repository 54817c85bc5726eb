"""`python -m engine.bench spec`: exact speculative decoding sweep on the tiny target.

For each workload (code, prose) and drafter (dense model, n-gram, EAGLE / MTP heads when trained):
tokens/s, speed-up over target-only decoding measured in the same run, τ, acceptance by depth,
mean distinct experts per layer per verification vs verified tokens (against the uniform-routing
curve M·[1 − (1 − r/M)^n]), drafter latency and memory, and transformers assisted generation with
the same dense drafter, interleaved with our best configuration. Greedy decoding, batch 1.

Every row's tok/s and speed-up come from one pair of interleaved runs: the configuration and a target-only
run next to it (`base_tok_s`, printed); "best exact" is the fastest exact row with K > 0 (`best_exact`: K = 0
is plain decoding). The defaults run for a long time (`spec_grid` configurations x repeats x 2 workloads);
the README's table used `README_OVERRIDES`.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine.bench.common import bench_paths, bench_prompts, hf_generate
from engine.bench.configs import SPEC_DRAFTERS, BenchConfig
from engine.cost.utility import expected_distinct_experts

# `python -m engine.bench spec` settings behind the README's table (the defaults sweep more: see BenchConfig)
README_OVERRIDES = "num_prompts=4 new_tokens=64 repeats=2 depths=[0,1,2,3,4,6,8] widths=[1,2,4]"


def spec_grid(cfg: BenchConfig, drafter_names: list[str]) -> list[tuple[str, int, int]]:
    """(drafter, K, W) of every row of the sweep: W = 1 only at K = 0, the n-gram drafter up to W = 2."""
    return [
        (d, K, W)
        for d in drafter_names
        for K in cfg.depths
        for W in (cfg.widths if K > 0 else [1])
        if not (d == "ngram" and W > 2)
    ]


def best_exact(rows: list[dict], drafter: str | None = None) -> dict | None:
    """The fastest row that reproduced the target-only tokens with K > 0 (K = 0 is plain decoding, not a
    speculative configuration), of `drafter` if given; None when there is none."""
    ok = [x for x in rows if x["exact"] and x["K"] > 0 and drafter in (None, x["drafter"])]
    return max(ok, key=lambda x: x["speedup"]) if ok else None


def check_spec_drafters(names: list[str]) -> None:
    """`spec_drafters` names only known drafters, at least one (before any model loads)."""
    unknown = sorted(set(names) - set(SPEC_DRAFTERS))
    if unknown or not names:
        raise ValueError(f"spec_drafters={list(names)}: choose one or more of {list(SPEC_DRAFTERS)}")


def _drafters(cfg: BenchConfig, target) -> dict[str, Any]:
    """The drafters of `cfg.spec_drafters` that this checkout has (the feature heads are optional)."""
    import engine
    from engine.zoo.build import zoo_path

    _, drafter_path = bench_paths(cfg)
    out: dict[str, Any] = {}
    if "dense" in cfg.spec_drafters:
        out["dense"] = engine.load_model(drafter_path)
    if "ngram" in cfg.spec_drafters:
        out["ngram"] = "ngram"
    for name in ("eagle-head", "mtp-head"):  # optional feature heads (python -m engine.zoo.train_heads)
        if name.removesuffix("-head") not in cfg.spec_drafters:
            continue
        try:
            path = zoo_path(name)
        except FileNotFoundError:
            continue
        from engine.drafting.make import load_feature_drafter

        try:  # the shipped predictor reads EAGLE features
            predictor = zoo_path("expert-predictor") if name == "eagle-head" else None
        except FileNotFoundError:
            predictor = None
        try:
            out[name.removesuffix("-head")] = load_feature_drafter(path, target, predictor=predictor)
        except ValueError:  # a head trained for another target checkpoint: skip it
            continue
    return out


def lambda_sweep(cfg: BenchConfig, target, drafter, prompts) -> list[dict]:
    """Expert-cost-aware node selection (EcoSpec 2607.12696): same tree pool and verify budget, λ and
    score varied; τ and distinct experts per layer per verification."""
    import engine

    eng = engine.Engine(target, drafter=drafter)
    rows = []
    for score in ("ecospec", "logp"):
        for lam in cfg.lams:
            if lam == 0 and score == "logp":
                continue
            spec = engine.SpecConfig(depth=4, width=2, frontier=4, max_verify=8, lam=lam, score=score)
            run = _run(eng, prompts, cfg.new_tokens, spec)
            run.pop("footprint")
            run.pop("tokens")
            rows.append({"score": score if lam else "probability", "lam": lam, **run})
    return rows


def _run(eng, prompts, n, spec) -> dict:
    t0 = time.perf_counter()
    res = eng.generate(prompts, n, spec=spec)
    wall = time.perf_counter() - t0
    rounds = [r for x in res for r in x.rounds]
    toks = sum(len(x.token_ids) for x in res)
    K = spec.depth if spec else 0
    att = [sum(r.attempted_by_depth[d] for r in rounds if len(r.attempted_by_depth) > d) for d in range(K)]
    acc = [sum(r.accepted_by_depth[d] for r in rounds if len(r.accepted_by_depth) > d) for d in range(K)]
    return {
        "wall": wall,
        "tok_s": toks / wall,
        "tau": toks / max(len(rounds), 1),
        "accept_by_depth": [a / t if t else None for a, t in zip(acc, att)],
        "draft_s_per_round": statistics.mean(r.time.get("draft", 0.0) for r in rounds),
        "verify_s_per_round": statistics.mean(r.time.get("forward", 0.0) for r in rounds),
        "verified_tokens": statistics.mean(r.verified_tokens for r in rounds),
        "distinct_experts": statistics.mean(r.mean_distinct_experts for r in rounds) if rounds else 0.0,
        "footprint": [(r.verified_tokens, r.mean_distinct_experts) for r in rounds],
        "tokens": [x.token_ids for x in res],
    }


def bench_spec(
    cfg: BenchConfig,
    progress: Callable[[str, int, int], None] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """The sweep; `progress(label, done, total)` after every configuration, `log` for the run-time estimate
    (the entry point draws and prints them)."""
    import engine

    check_spec_drafters(cfg.spec_drafters)
    target_path, drafter_path = bench_paths(cfg)
    target = engine.load_model(target_path)
    bench_prompts(cfg, target, 1)  # a checkpoint without a tokenizer fails here, before the drafters load
    drafters = _drafters(cfg, target)
    M, r = target.config.num_experts, target.config.top_r
    workloads = ("code", "prose")
    grid = spec_grid(cfg, list(drafters))
    lam_drafter = drafters.get("eagle") or drafters.get("mtp")
    with_lam = lam_drafter is not None and getattr(lam_drafter, "predictor", None) is not None
    lam_rows = 2 * len(cfg.lams) - (0.0 in cfg.lams) if with_lam else 0
    hf = cfg.hf and "dense" in drafters  # transformers assisted generation runs the dense drafter
    total, done = len(workloads) * (len(grid) + lam_rows + hf), 0
    report: dict[str, Any] = {
        "config": {k: getattr(cfg, k) for k in ("new_tokens", "num_prompts", "repeats", "depths", "widths")}
    }
    for wl in workloads:
        cfg_wl = BenchConfig(**{**cfg.__dict__, "workload": wl})
        prompts = bench_prompts(cfg_wl, target, cfg.num_prompts)
        base_eng = engine.Engine(target)
        base_eng.generate(prompts[:1], 8)
        base = _run(base_eng, prompts, cfg.new_tokens, None)
        if wl == workloads[0]:  # every configuration runs `repeats` times next to a target-only run
            est = base["wall"] * len(workloads) * (2 * cfg.repeats * len(grid) + 2 * lam_rows)
            log(
                f"expected run time: ~{f'{est:.0f} s' if est < 120 else f'{est / 60:.0f} min'} + model loading"
                + (" + transformers assisted generation" if hf else "")
                + f" ({len(grid)} configurations x {cfg.repeats} repeats x {len(workloads)} workloads, "
                f"one target-only run of {cfg.num_prompts} prompts x {cfg.new_tokens} tokens took {base['wall']:.1f} s)"
            )
        rows = []
        footprint: dict[int, list[float]] = defaultdict(list)
        engines = {name: engine.Engine(target, drafter=d) for name, d in drafters.items()}
        for dname, K, W in grid:
            spec = engine.SpecConfig(depth=K, width=W)
            # interleave with target-only runs: tok/s and speed-up come from the same pair of runs
            runs, bases = [], []
            for _ in range(cfg.repeats):
                runs.append(_run(engines[dname], prompts, cfg.new_tokens, spec))
                bases.append(_run(base_eng, prompts, cfg.new_tokens, None))
            run = min(runs, key=lambda x: x["wall"])
            b = min(bases, key=lambda x: x["wall"])
            exact = run["tokens"] == base["tokens"]
            for n, u in run.pop("footprint"):
                footprint[n].append(u)
            run.pop("tokens")
            speedup = run["tok_s"] / b["tok_s"]
            rows.append({"drafter": dname, "K": K, "W": W, **run, "base_tok_s": b["tok_s"], "speedup": speedup,
                         "exact": exact})  # fmt: skip
            done += 1
            if progress is not None:
                progress(f"{wl} {dname} K={K} W={W}", done, total)
        curve = [
            {"n": n, "distinct": statistics.mean(v), "uniform": expected_distinct_experts(M, r, n)}
            for n, v in sorted(footprint.items())
        ]
        best, best_dense = best_exact(rows), best_exact(rows, "dense")
        section = {
            "rows": rows,
            "footprint_curve": curve,
            "best": best,
            "best_dense": best_dense,
            "target_only_tok_s": base["tok_s"],
        }
        if hf and best is not None and best_dense is not None:
            section["assisted"] = _vs_assisted(
                cfg, target, drafters, target_path, drafter_path, prompts, best_dense, best
            )
        if hf:
            done += 1
            if progress is not None:
                progress(f"{wl} transformers assisted", done, total)
        section["drafter_memory_mb"] = {
            k: sum(p.numel() * p.element_size() for p in d.parameters()) / 1e6
            for k, d in drafters.items()
            if hasattr(d, "parameters")
        }
        if with_lam:
            section["lambda_sweep"] = lambda_sweep(cfg, target, lam_drafter, prompts)
            done += lam_rows
            if progress is not None:
                progress(f"{wl} lambda sweep", done, total)
        report[wl] = section
    return report


def _vs_assisted(cfg, target, drafters, target_path, drafter_path, prompts, best_dense, best) -> dict:
    """transformers assisted generation with the dense drafter, interleaved with two of our exact configs: the
    best speculative one with the same dense drafter (same pair) and our best one of any drafter."""
    import transformers

    import engine

    hf_t = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    hf_d = transformers.AutoModelForCausalLM.from_pretrained(drafter_path, dtype=torch.float32).eval()
    ours = {}
    for key, row in (("same_pair", best_dense), ("best_any", best)):
        eng = engine.Engine(target, drafter=drafters[row["drafter"]], instrument=False, timing=False)
        ours[key] = (eng, engine.SpecConfig(depth=row["K"], width=row["W"]), row)
    times: dict[str, float] = {"same_pair": 0.0, "best_any": 0.0, "hf": 0.0}
    match = True
    for _ in range(max(cfg.repeats, 3)):
        for p in prompts:
            outs = []
            for key, (eng, spec, _) in ours.items():
                t0 = time.perf_counter()
                outs.append(eng.generate([p], cfg.new_tokens, spec=spec)[0].token_ids)
                times[key] += time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = hf_generate(hf_t, [p], cfg.new_tokens, assistant=hf_d)[0]
            times["hf"] += time.perf_counter() - t0
            match &= all(ref == o for o in outs)
    cfg_name = lambda row: f"{row['drafter']} K={row['K']} W={row['W']}"  # noqa: E731
    return {
        "hf_assisted_s": times["hf"],
        "ours_s": times["same_pair"],
        "speedup": times["hf"] / times["same_pair"],
        "config": cfg_name(best_dense),
        "best_any_s": times["best_any"],
        "best_any_speedup": times["hf"] / times["best_any"],
        "best_any_config": cfg_name(best),
        "same_tokens": match,
    }


def print_spec(res: dict) -> None:
    for wl in ("code", "prose"):
        s = res[wl]
        base = s["target_only_tok_s"]
        print(
            f"\n== {wl}: exact speculative decoding (greedy, batch 1); target-only {base:.0f} tok/s in a first run, "
            "each row's speed-up = its tok/s / its own interleaved target-only run (base tok/s) =="
        )
        print(
            f"{'drafter':>8} {'K':>2} {'W':>2} {'tok/s':>7} {'base':>7} {'speedup':>7} {'tau':>5} {'n':>5} {'U_l':>5} "
            f"{'draft ms':>8} {'verify ms':>9}  acceptance by depth"
        )
        for x in s["rows"]:
            acc = " ".join("-" if a is None else f"{a:.2f}" for a in x["accept_by_depth"])
            print(
                f"{x['drafter']:>8} {x['K']:>2} {x['W']:>2} {x['tok_s']:>7.0f} {x['base_tok_s']:>7.0f} "
                f"{x['speedup']:>6.2f}x {x['tau']:>5.2f} "
                f"{x['verified_tokens']:>5.1f} {x['distinct_experts']:>5.2f} {x['draft_s_per_round'] * 1e3:>8.2f} "
                f"{x['verify_s_per_round'] * 1e3:>9.2f}  {acc}{'' if x['exact'] else '  NOT EXACT'}"
            )
        print("\ndistinct experts per layer per verification vs verified tokens (uniform routing in brackets):")
        print("  " + "  ".join(f"n={c['n']}: {c['distinct']:.2f} ({c['uniform']:.2f})" for c in s["footprint_curve"]))
        b = s["best"]
        if b is None:
            print("\nbest exact: none (no configuration with K > 0 reproduced the target-only tokens)")
        else:
            print(
                f"\nbest exact (K > 0): {b['drafter']} K={b['K']} W={b['W']}: {b['tok_s']:.0f} tok/s, "
                f"{b['speedup']:.2f}x over its target-only run ({b['base_tok_s']:.0f} tok/s)"
            )
        if "assisted" in s:
            a = s["assisted"]
            print(
                f"vs transformers assisted generation with the same dense drafter (interleaved, identical tokens: "
                f"{a['same_tokens']}): ours {a['config']} {a['speedup']:.2f}x faster; "
                f"our best exact config {a['best_any_config']} {a['best_any_speedup']:.2f}x faster"
            )
        print("drafter memory (MB):", {k: round(v, 2) for k, v in s["drafter_memory_mb"].items()})
        if "lambda_sweep" in s:
            print("\nexpert-cost-aware selection (EAGLE drafter, K=4 W=2 frontier 4, 8 verified nodes):")
            print(f"{'score':>12} {'lambda':>6} {'tau':>5} {'experts/layer':>13} {'tok/s':>7}")
            for x in s["lambda_sweep"]:
                print(
                    f"{x['score']:>12} {x['lam']:>6.2f} {x['tau']:>5.2f} {x['distinct_experts']:>13.2f} "
                    f"{x['tok_s']:>7.0f}"
                )
