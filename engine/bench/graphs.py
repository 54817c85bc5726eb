"""`python -m engine.bench graphs` (CUDA only): eager vs CUDA-graph decode vs transformers on a Qwen3-30B-A3B shape.

A random bf16 checkpoint shaped like Qwen3-30B-A3B (hidden 2048, 128 experts top-8, expert dim 768, 32 query / 4
KV heads, vocab 151936) with `graphs.layers` layers (48 in the real model; fewer to fit the time and memory of
one check, the per-layer figures scale), saved by transformers and loaded through our checkpoint code. For batch
sizes 1 and 8: tokens/s of target-only greedy decode, eager (`Engine`) vs graphs (`Engine(cuda_graphs=True)`) vs
transformers `generate`, interleaved; the greedy tokens of the three must agree; and the decode step against the
weight-read roofline (bytes of dense weights + LM head + the distinct experts a step's tokens route to, at the
GPU's HBM bandwidth from conf/hardware).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.bench.bound import weight_bytes
from engine.bench.common import hf_generate

QWEN3_30B_A3B = dict(
    hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, norm_topk_prob=True,
)  # fmt: skip


def _hbm_bandwidth() -> float:
    from engine.cost.roofline import load_hardware

    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return load_hardware(key).hbm_bandwidth
    return load_hardware("h100").hbm_bandwidth


def bench_graphs(layers: int, batch_sizes: list[int], new_tokens: int, repeats: int, hf: bool) -> dict:
    """Rows per batch size (module docstring). Raises RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("python -m engine.bench graphs needs a CUDA GPU (CUDA graphs); this machine has none")
    import transformers

    import engine

    out: dict = {"layers": layers, "device": torch.cuda.get_device_name(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="expertspec-graphs-") as tmp:
        config = transformers.AutoConfig.for_model(
            "qwen3_moe", num_hidden_layers=layers, max_position_embeddings=4096, **QWEN3_30B_A3B
        )
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        ref.save_pretrained(Path(tmp) / "ckpt")
        ref = ref.cuda() if hf else None
        model = engine.load_model(Path(tmp) / "ckpt", device="cuda", dtype="bfloat16")
    bw = _hbm_bandwidth()
    eager = engine.Engine(model, instrument=False, timing=False)
    graphed = engine.Engine(model, instrument=False, timing=False, cuda_graphs=True)
    routed = engine.Engine(model, instrument=True, timing=False)
    for bsz in batch_sizes:
        gen = torch.Generator().manual_seed(bsz)
        prompts = torch.randint(0, config.vocab_size, (bsz, 64), generator=gen).tolist()
        eager.generate(prompts, 4), graphed.generate(prompts, 4)  # warm-up and capture
        times: dict[str, list[float]] = {"eager": [], "graphs": [], "transformers": []}
        tokens = {}
        for _ in range(repeats):
            for name, eng in (("eager", eager), ("graphs", graphed)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = eng.generate(prompts, new_tokens)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
                tokens[name] = [r.token_ids for r in res]
            if ref is not None:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tokens["transformers"] = hf_generate(ref, prompts, new_tokens)
                torch.cuda.synchronize()
                times["transformers"].append(time.perf_counter() - t0)
        rounds = routed.generate(prompts, 8)[0].rounds[2:]
        distinct = statistics.mean(sum(r.distinct_experts) for r in rounds)  # Σ_l U_l per step
        bound = weight_bytes(model, distinct)[0] / bw
        row = {"batch": bsz, "roofline_step_s": bound, "agree": tokens["eager"] == tokens["graphs"]}
        if "transformers" in tokens:
            row["agree_transformers"] = tokens["eager"] == tokens["transformers"]
        for name, ts in times.items():
            if ts:
                step = statistics.median(ts) / new_tokens
                row[f"{name}_tok_s"] = bsz / step
                row[f"{name}_step_over_roofline"] = step / bound
        out["rows"].append(row)
    stats = graphed._graphed.stats
    out["graph_stats"] = {"captured": stats.captured, "replayed": stats.replayed, "eager": stats.eager,
                          "buckets": {str(k): v for k, v in stats.buckets.items()}}  # fmt: skip
    return out
