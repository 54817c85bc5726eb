"""Benchmarks (not timed tests). Hydra entry point:

    python -m engine.bench                 # decode: our target-only decoding vs transformers generate
    python -m engine.bench spec            # speculative sweep K x W, drafters, vs transformers assisted
    python -m engine.bench spec new_tokens=32 repeats=1      # any config override
    python -m engine.bench cost            # verification cost: measured phases, fitted model, GPU what-if
    python -m engine.bench graphs          # CUDA: eager vs CUDA-graph decode vs transformers, Qwen3-30B-A3B shape
    python -m engine.bench policy          # a deployed frozen policy's cost per round (observation + call)

Every ratio is measured side by side in one process with runs interleaved (ours, theirs, ours, ...),
single intra-op thread by default (DESIGN.md §8). Results are printed as tables and written as JSON
to `bench.out` (default bench_<mode>.json in the working directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from tqdm import tqdm

from engine.bench.configs import MODES, BenchConfig
from engine.bench.decode import bench_decode
from engine.bench.hf_reference import require_transformers
from engine.cli import quiet_hydra_argv


def _print_decode(res: dict) -> None:
    print("\n== target-only decode: expertspec vs transformers generate (greedy, fp32, interleaved) ==")
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}")
    for k, r in res.items():
        if k.startswith("batch"):
            print(
                f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r.get('hf_tok_s', float('nan')):>9.1f} "
                f"{r.get('speedup', float('nan')):>6.2f}x"
            )
    s = res["step"]
    print(
        f"\ndecode step {s['step_seconds'] * 1e3:.2f} ms vs weight-read bound {s['bound_seconds'] * 1e3:.2f} ms "
        f"({s['weight_bytes'] / 1e6:.1f} MB touched at {s['bandwidth_Bps'] / 1e9:.1f} GB/s measured): "
        f"{s['bound_ratio']:.1f}x the bound"
    )
    print(
        "\nverification cost curve T(n)/T(1): "
        + "  ".join(f"n={r['tokens']}: {r['seconds'] * 1e3:.2f} ms ({r['ratio']:.2f}x)" for r in res["verify_curve"])
    )
    if "bound" in res:
        _print_bound(res["bound"])
    for w in res.get("warnings", []):
        print("WARNING:", w)


def _print_bound(res: dict) -> None:
    bw, after = res["bandwidth"], res["bandwidth_after"]
    print(
        f"\n== unseen random checkpoints vs the weight-read bound (fp32, batch 1, one thread) ==\n"
        f"streaming read {bw['stream_Bps'] / 1e9:.1f} GB/s over {bw['stream_buffer_bytes'] / 2**20:.0f} MB (after: "
        f"{after['stream_Bps'] / 1e9:.1f}; last-level cache {bw['llc_bytes'] / 2**20:.0f} MB), large gemv "
        f"{bw['gemv_Bps'] / 1e9:.1f} GB/s, large GEMM {bw['gemm_flops'] / 1e9:.0f} GFLOP/s"
    )
    print(f"{'shape':>16} {'n':>3} {'U/layer':>7} {'MB read':>8} {'ms':>7} {'bound ms':>8} {'x bound':>7} "
          f"{'x gemv':>6} {'x roofline':>10} {'hf ms':>7} {'vs hf':>6}")  # fmt: skip
    for name, shape in res["shapes"].items():
        for r in shape["rows"]:
            hf = f"{r['hf_seconds'] * 1e3:>7.2f} {r['speedup_vs_hf']:>5.2f}x" if "hf_seconds" in r else ""
            print(
                f"{name:>16} {r['tokens']:>3} {r['mean_distinct_experts']:>7.1f} {r['weight_bytes'] / 1e6:>8.1f} "
                f"{r['seconds'] * 1e3:>7.2f} {r['bound_seconds'] * 1e3:>8.2f} {r['bound_ratio']:>6.2f}x "
                f"{r['gemv_bound_ratio']:>5.2f}x {r['roofline_ratio']:>9.2f}x {hf}"
            )
    for w in res.get("warnings", []):
        print("WARNING:", w)


def _quiet_transformers() -> None:
    """No transformers warnings or weight-loading bars between our tables (errors still show); a clear error first
    where transformers cannot load beside our `kernels` package."""
    try:
        transformers = require_transformers()
    except RuntimeError as e:
        raise SystemExit(str(e)) from None

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


@hydra.main(config_path=None, config_name="bench_schema", version_base=None)
def main(cfg: BenchConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    if cfg.mode not in MODES:
        raise SystemExit(f"unknown bench mode {cfg.mode!r}; use one of {MODES}")
    torch.set_num_threads(cfg.threads)
    if cfg.mode in ("decode", "spec", "graphs"):  # the modes that load transformers as their reference
        _quiet_transformers()
    if cfg.mode == "decode":
        bar = tqdm(total=len(cfg.bound.shapes) if cfg.bound.enabled else 0, desc="unseen shapes")
        res = bench_decode(cfg, progress=lambda name: bar.update(1))
        bar.close()
        _print_decode(res)
    elif cfg.mode == "serve":
        from engine.bench.serve import bench_serve, plot_serve, print_serve

        c = cfg.serve_bench
        bar = tqdm(total=len(c.policies) * (len(c.rates) + 1), desc="serve scenarios")
        res = bench_serve(cfg, progress=lambda: bar.update(1))
        bar.close()
        print_serve(res)
        if c.plot:
            png = Path(hydra.utils.to_absolute_path((cfg.out or "bench_serve.json").rsplit(".", 1)[0] + "_tpot.png"))
            plot_serve(res, png)
            print(f"plot: {png}")
    elif cfg.mode == "graphs":
        from engine.bench.graphs import bench_graphs

        try:
            res = bench_graphs(cfg.graphs.layers, cfg.batch_sizes, cfg.graphs.new_tokens, cfg.repeats, cfg.hf)
        except RuntimeError as err:
            raise SystemExit(str(err)) from None
        for r in res["rows"]:
            print(r)
    elif cfg.mode == "policy":
        from engine.bench.policy import bench_policy, print_policy

        c = cfg.policy_bench
        bar = tqdm(total=len(c.batch_sizes) * c.repeats, desc="policy overhead (batch sizes × repeats)")
        res = bench_policy(cfg, progress=lambda: bar.update(1))
        bar.close()
        print_policy(res)
    elif cfg.mode == "cost":
        from engine.bench.cost import bench_cost, print_cost

        res = bench_cost(cfg)
        print_cost(res)
    else:
        from engine.bench.spec import README_OVERRIDES, bench_spec, print_spec

        shown = ("num_prompts", "new_tokens", "repeats", "depths", "widths", "lams", "hf")
        as_override = lambda v: "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v).lower()
        print("settings: " + " ".join(f"{k}={as_override(getattr(cfg, k))}" for k in shown))
        print(f"the README's table: python -m engine.bench spec {README_OVERRIDES}")
        bar = None

        def progress(label: str, done: int, total: int) -> None:
            nonlocal bar
            if bar is None:
                bar = tqdm(total=total, desc="spec sweep", dynamic_ncols=True)
            bar.set_postfix_str(label)
            bar.update(done - bar.n)

        res = bench_spec(cfg, progress=progress, log=tqdm.write)
        if bar is not None:
            bar.close()
        print_spec(res)
    out = Path(hydra.utils.to_absolute_path(cfg.out or f"bench_{cfg.mode}.json"))
    out.write_text(json.dumps(res, indent=2, default=float))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    quiet_hydra_argv(MODES)
    main()
