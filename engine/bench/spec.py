"""`python -m engine.bench spec`: exact speculative decoding sweep on the tiny target.

For each workload (code, prose) and drafter (dense model, n-gram, EAGLE / MTP heads when trained):
tokens/s, speed-up over target-only decoding measured in the same run, τ, acceptance by depth,
mean distinct experts per layer per verification vs verified tokens (against the uniform-routing
curve M·[1 − (1 − r/M)^n]), drafter latency and memory, and transformers assisted generation with
the same dense drafter, interleaved with our best configuration. Greedy decoding, batch 1.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from engine.bench.common import bench_paths, hf_generate
from engine.bench.configs import BenchConfig
from engine.bench.decode import bench_prompts


def _drafters(cfg: BenchConfig, target) -> dict[str, Any]:
    import engine
    from engine.zoo.build import zoo_path

    _, drafter_path = bench_paths(cfg)
    out: dict[str, Any] = {"dense": engine.load_model(drafter_path), "ngram": "ngram"}
    for name in ("eagle-head", "mtp-head"):  # optional feature heads (python -m engine.train_heads)
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


def bench_spec(cfg: BenchConfig) -> dict:
    import engine

    target_path, drafter_path = bench_paths(cfg)
    target = engine.load_model(target_path)
    drafters = _drafters(cfg, target)
    M, r = target.config.num_experts, target.config.top_r
    report: dict[str, Any] = {"config": {k: getattr(cfg, k) for k in ("new_tokens", "num_prompts", "repeats")}}
    for wl in ("code", "prose"):
        cfg_wl = BenchConfig(**{**cfg.__dict__, "workload": wl})
        prompts = bench_prompts(cfg_wl, target.tokenizer, cfg.num_prompts)
        base_eng = engine.Engine(target)
        base_eng.generate(prompts[:1], 8)
        base = _run(base_eng, prompts, cfg.new_tokens, None)
        rows = []
        footprint: dict[int, list[float]] = defaultdict(list)
        for dname, drafter in drafters.items():
            eng = engine.Engine(target, drafter=drafter)
            for K in cfg.depths:
                for W in cfg.widths if K > 0 else [1]:
                    if dname == "ngram" and W > 2:
                        continue
                    spec = engine.SpecConfig(depth=K, width=W)
                    # interleave with target-only runs so the speed-up is side by side
                    runs, bases = [], []
                    for _ in range(cfg.repeats):
                        runs.append(_run(eng, prompts, cfg.new_tokens, spec))
                        bases.append(_run(base_eng, prompts, cfg.new_tokens, None))
                    run = min(runs, key=lambda x: x["wall"])
                    b = min(bases, key=lambda x: x["wall"])
                    exact = run["tokens"] == base["tokens"]
                    for n, u in run.pop("footprint"):
                        footprint[n].append(u)
                    run.pop("tokens")
                    rows.append(
                        {
                            "drafter": dname,
                            "K": K,
                            "W": W,
                            **run,
                            "speedup": b["wall"] / run["wall"],
                            "exact": exact,
                        }
                    )
        curve = [
            {"n": n, "distinct": statistics.mean(v), "uniform": M * (1 - (1 - r / M) ** n)}
            for n, v in sorted(footprint.items())
        ]
        best = max((x for x in rows if x["exact"]), key=lambda x: x["speedup"])
        dense_spec = [x for x in rows if x["exact"] and x["drafter"] == "dense" and x["K"] > 0]
        best_dense = max(dense_spec or rows, key=lambda x: x["speedup"])  # a real speculative config
        section = {
            "rows": rows,
            "footprint_curve": curve,
            "best": best,
            "best_dense": best_dense,
            "target_only_tok_s": base["tok_s"],
        }
        if cfg.hf:
            section["assisted"] = _vs_assisted(
                cfg, target, drafters, target_path, drafter_path, prompts, best_dense, best
            )
        section["drafter_memory_mb"] = {
            k: sum(p.numel() * p.element_size() for p in d.parameters()) / 1e6
            for k, d in drafters.items()
            if hasattr(d, "parameters")
        }
        lam_drafter = drafters.get("eagle") or drafters.get("mtp")
        if lam_drafter is not None and getattr(lam_drafter, "predictor", None) is not None:
            section["lambda_sweep"] = lambda_sweep(cfg, target, lam_drafter, prompts)
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
        print(f"\n== {wl}: exact speculative decoding (greedy, batch 1), target-only {base:.0f} tok/s ==")
        print(
            f"{'drafter':>8} {'K':>2} {'W':>2} {'tok/s':>7} {'speedup':>7} {'tau':>5} {'n':>5} {'U_l':>5} "
            f"{'draft ms':>8} {'verify ms':>9}  acceptance by depth"
        )
        for x in s["rows"]:
            acc = " ".join("-" if a is None else f"{a:.2f}" for a in x["accept_by_depth"])
            print(
                f"{x['drafter']:>8} {x['K']:>2} {x['W']:>2} {x['tok_s']:>7.0f} {x['speedup']:>6.2f}x {x['tau']:>5.2f} "
                f"{x['verified_tokens']:>5.1f} {x['distinct_experts']:>5.2f} {x['draft_s_per_round'] * 1e3:>8.2f} "
                f"{x['verify_s_per_round'] * 1e3:>9.2f}  {acc}{'' if x['exact'] else '  NOT EXACT'}"
            )
        print("\ndistinct experts per layer per verification vs verified tokens (uniform routing in brackets):")
        print("  " + "  ".join(f"n={c['n']}: {c['distinct']:.2f} ({c['uniform']:.2f})" for c in s["footprint_curve"]))
        b = s["best"]
        print(f"\nbest exact: {b['drafter']} K={b['K']} W={b['W']}: {b['speedup']:.2f}x over target-only")
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
