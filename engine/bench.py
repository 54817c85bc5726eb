"""Benchmarks (not timed tests). Hydra entry point:

    python -m engine.bench                 # decode: our target-only decoding vs transformers generate
    python -m engine.bench spec            # speculative sweep K x W, drafters, vs transformers assisted
    python -m engine.bench spec new_tokens=32 repeats=1      # any config override
    python -m engine.bench cost            # verification cost: measured phases, fitted model, GPU what-if

Every ratio is measured side by side in one process with runs interleaved (ours, theirs, ours, ...),
single intra-op thread by default (DESIGN.md §8). Results are printed as tables and written as JSON
to `bench.out` (default bench_<mode>.json in the working directory).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .bench_cost import CostBenchConfig
from .cli import quiet_hydra_argv

MODES = ("decode", "spec", "cost")


@dataclass
class BenchConfig:
    mode: str = "decode"
    target: str | None = None  # checkpoint folder; None = the zoo's tiny-moe
    drafter: str | None = None  # None = the zoo's tiny-dense
    workload: str = "mixed"  # code | prose | mixed
    prompts: str | None = None  # FastChat / HumanEval JSONL path
    num_prompts: int = 8
    prompt_len: int = 64
    new_tokens: int = 128
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    repeats: int = 3
    threads: int = 1
    depths: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5, 6, 7, 8])
    widths: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    lams: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0, 2.0, 4.0])
    hf: bool = True  # also run transformers (decode) / assisted generation (spec)
    out: str | None = None
    mem_bandwidth: float = 14e9  # B/s, one-thread read bandwidth of this machine class (DESIGN §8)
    cost: CostBenchConfig = field(default_factory=CostBenchConfig)  # mode=cost settings (cost.sizes=...)


cs = ConfigStore.instance()
cs.store(name="bench_schema", node=BenchConfig)


def _paths(cfg: BenchConfig) -> tuple[str, str]:
    if cfg.target and cfg.drafter:
        return cfg.target, cfg.drafter
    from .zoo import zoo_path

    return cfg.target or str(zoo_path("tiny-moe")), cfg.drafter or str(zoo_path("tiny-dense"))


def _prompts(cfg: BenchConfig, tokenizer, n: int) -> list[list[int]]:
    from .workloads import encode, workload

    ps = workload(cfg.workload, n, cfg.prompts)
    if not ps:
        raise ValueError("the workload produced no prompts")
    while len(ps) < n:
        ps = ps + ps
    return encode(tokenizer, ps[:n], cfg.prompt_len)


def _equal_length(prompts: list[list[int]]) -> list[list[int]]:
    """Trim to a common length so transformers needs no padding (same prompts for both engines)."""
    m = min(len(p) for p in prompts)
    return [p[-m:] for p in prompts]


# ---------------------------------------------------------------------------------------------- decode
def bench_decode(cfg: BenchConfig) -> dict:
    import engine

    target_path, _ = _paths(cfg)
    ours = engine.load_model(target_path)
    eng = engine.Engine(ours, instrument=False, timing=False)
    hf = None
    if cfg.hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    results = {}
    for bsz in cfg.batch_sizes:
        prompts = _equal_length(_prompts(cfg, ours.tokenizer, bsz))
        n = cfg.new_tokens
        eng.generate(prompts, 4)  # warm-up
        if hf is not None:
            _hf_generate(hf, prompts, 4)
        ours_t, hf_t = [], []
        for _ in range(cfg.repeats):
            t0 = time.perf_counter()
            res = eng.generate(prompts, n)
            ours_t.append(time.perf_counter() - t0)
            if hf is not None:
                t0 = time.perf_counter()
                ref = _hf_generate(hf, prompts, n)
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
    results["step"] = _step_vs_bound(ours, cfg)
    results["verify_curve"] = verify_cost_curve(ours, [1, 2, 4, 8, 16, 32], cfg.repeats)
    return results


def _hf_generate(hf, prompts: list[list[int]], n: int, assistant=None) -> list[list[int]]:
    """transformers greedy `generate` of exactly n new tokens (assisted generation when `assistant` is given);
    an explicit all-ones attention mask, or transformers masks every prompt token equal to the pad id."""
    ids = torch.tensor(prompts)
    kwargs = {} if assistant is None else {"assistant_model": assistant}
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[:, ids.shape[1] :].tolist()


def _step_vs_bound(model, cfg: BenchConfig) -> dict:
    import engine

    prompt = _prompts(cfg, model.tokenizer, 1)
    routed = engine.Engine(model, instrument=True, timing=False).generate(prompt, 64)[0].rounds[8:]
    mean_u = statistics.mean(r.mean_distinct_experts for r in routed) if model.config.is_moe else 0
    plain = engine.Engine(model, instrument=False, timing=False).generate(prompt, 64)[0].rounds[8:]
    step_s = statistics.median(r.round_seconds for r in plain)
    cfgm = model.config
    per_param = model.dtype.itemsize
    # every dense weight, the LM head (tied or not) and the routed experts; the embedding reads one row
    dense = sum(
        p.numel() for n_, p in model.named_parameters() if ".mlp.experts." not in n_ and "embed_tokens" not in n_
    )
    if cfgm.tie_word_embeddings:
        dense += model.lm_head.weight.numel()
    expert = 3 * cfgm.hidden_size * cfgm.moe_intermediate_size
    touched = (dense + len(cfgm.moe_layers) * mean_u * expert) * per_param
    bound = touched / cfg.mem_bandwidth
    return {
        "step_seconds": step_s,
        "weight_bytes": touched,
        "bound_seconds": bound,
        "bound_ratio": step_s / bound,
    }


def verify_cost_curve(model, sizes: list[int], repeats: int = 3) -> list[dict]:
    """Median seconds of one cached target forward over n new chain tokens, and T(n)/T(1)."""
    from .batching import chain_item, pack
    from .kv_cache import PagedKVCache

    cfg = model.config
    kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 16, model.dtype, model.device)
    kv.add_sequence(0)
    kv.reserve(0, 512)
    ctx = 128
    slots = kv.slots(0, range(ctx + max(sizes)))
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab_size, (ctx + max(sizes),), generator=gen)
    with torch.inference_mode():
        model.forward_batch(pack([chain_item(toks[:ctx], slots[:0], slots[:ctx])], model.device), kv)
        rows = []
        for n in sizes:
            item = chain_item(toks[ctx : ctx + n], slots[:ctx], slots[ctx : ctx + n])
            batch = pack([item], model.device)
            times = []
            for _ in range(max(repeats, 3) * 3):
                t0 = time.perf_counter()
                model.forward_batch(batch, kv)
                times.append(time.perf_counter() - t0)
            rows.append({"tokens": n, "seconds": statistics.median(times)})
    kv.release(0)
    base = rows[0]["seconds"]
    for r in rows:
        r["ratio"] = r["seconds"] / base
    return rows


# ---------------------------------------------------------------------------------------------- report
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
        f"({s['weight_bytes'] / 1e6:.1f} MB touched): {s['bound_ratio']:.1f}x the bound"
    )
    print(
        "\nverification cost curve T(n)/T(1): "
        + "  ".join(f"n={r['tokens']}: {r['seconds'] * 1e3:.2f} ms ({r['ratio']:.2f}x)" for r in res["verify_curve"])
    )
    for w in res.get("warnings", []):
        print("WARNING:", w)


@hydra.main(config_path=None, config_name="bench_schema", version_base=None)
def main(cfg: BenchConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    if cfg.mode not in MODES:
        raise SystemExit(f"unknown bench mode {cfg.mode!r}; use one of {MODES}")
    torch.set_num_threads(cfg.threads)
    if cfg.mode == "decode":
        res = bench_decode(cfg)
        _print_decode(res)
    elif cfg.mode == "cost":
        from .bench_cost import bench_cost, print_cost

        res = bench_cost(cfg)
        print_cost(res)
    else:
        from .bench_spec import bench_spec, print_spec

        res = bench_spec(cfg)
        print_spec(res)
    out = Path(hydra.utils.to_absolute_path(cfg.out or f"bench_{cfg.mode}.json"))
    out.write_text(json.dumps(res, indent=2, default=float))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    quiet_hydra_argv(MODES)
    main()
