"""`python -m engine.bench` (decode mode): our target-only decoding vs transformers `generate`, the decode
step against the weight-read bound, and the verification cost curve T(n)/T(1). Interleaved runs, one thread."""

from __future__ import annotations

import statistics
import time

import torch

from engine.bench.bound import bench_bound, forward_step, measure_bandwidth, weight_bytes
from engine.bench.common import bench_paths, bench_prompts, equal_length, hf_generate
from engine.bench.configs import BenchConfig
from engine.cost.verify_curve import cached_verify_curve


# ---------------------------------------------------------------------------------------------- decode
def bench_decode(cfg: BenchConfig, progress=None) -> dict:
    import engine

    target_path, _ = bench_paths(cfg)
    ours = engine.load_model(target_path)
    eng = engine.Engine(ours, instrument=False, timing=False)
    hf = None
    if cfg.hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    results = {}
    for bsz in cfg.batch_sizes:
        prompts = equal_length(bench_prompts(cfg, ours, bsz))
        n = cfg.new_tokens
        eng.generate(prompts, 4)  # warm-up
        if hf is not None:
            hf_generate(hf, prompts, 4)
        ours_t, hf_t = [], []
        for _ in range(cfg.repeats):
            t0 = time.perf_counter()
            res = eng.generate(prompts, n)
            ours_t.append(time.perf_counter() - t0)
            if hf is not None:
                t0 = time.perf_counter()
                ref = hf_generate(hf, prompts, n)
                hf_t.append(time.perf_counter() - t0)
                if bsz == 1 and ref[0] != res[0].token_ids:
                    results.setdefault("warnings", []).append("greedy outputs differ from transformers")
        tok = bsz * n
        row = {"batch": bsz, "new_tokens": n, "ours_tok_s": tok / statistics.median(ours_t)}
        if hf_t:
            row["hf_tok_s"] = tok / statistics.median(hf_t)
            row["speedup"] = row["ours_tok_s"] / row["hf_tok_s"]
        results[f"batch{bsz}"] = row
    # decode step vs the memory-bandwidth bound, and the verification cost curve T(n)/T(1)
    bw = measure_bandwidth()  # the bound's bandwidth, measured in this run
    results["step"] = _step_vs_bound(ours, cfg, bw["stream_Bps"])
    results["verify_curve"] = cached_verify_curve(ours, [1, 2, 4, 8, 16, 32], cfg.repeats)
    if cfg.bound.enabled:  # random unseen shapes: decode and verification against the weight-read bound
        b = cfg.bound
        results["bound"] = bench_bound(b.shapes, b.sizes, b.new_tokens, cfg.repeats, cfg.hf, progress, bw)
    return results


def _step_vs_bound(model, cfg: BenchConfig, bandwidth: float) -> dict:
    import engine

    prompt = bench_prompts(cfg, model, 1)
    routed = engine.Engine(model, instrument=True, timing=False).generate(prompt, 64)[0].rounds[8:]
    mean_u = statistics.mean(r.mean_distinct_experts for r in routed) if model.config.is_moe else 0
    plain = engine.Engine(model, instrument=False, timing=False).generate(prompt, 64)[0].rounds[8:]
    step_s = statistics.median(forward_step(r) for r in plain)
    touched, _ = weight_bytes(model, len(model.config.moe_layers) * mean_u)
    bound = touched / bandwidth
    return {
        "step_seconds": step_s,
        "weight_bytes": touched,
        "bound_seconds": bound,
        "bound_ratio": step_s / bound,
        "bandwidth_Bps": bandwidth,
    }
