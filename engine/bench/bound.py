"""The weight-read bound for unseen shapes (`python -m engine.bench`, decode mode, `bound.shapes`).

For random checkpoints of several sizes, saved by transformers and loaded through our checkpoint code:

    bound(step) = bytes of the weights the step must read / streaming read bandwidth

where the bytes are every dense weight, the LM head and, per MoE layer, the distinct experts the step's
tokens actually route to (U_l, from the routing record), and the bandwidth is measured in the same run (a
`.sum()` over a buffer far larger than the last-level cache; a large gemv is reported next to it as a
second reference). Target-only decode at batch 1 and verification forwards of n chain tokens over a
cached context are timed (medians, one thread) next to transformers on the same checkpoint and tokens, and
every ratio is step / bound. The compute roofline (FLOPs at the rate of a large GEMM measured in the same
run) is reported too: at n >= 8 on one CPU core it, not the weight reads, can be the binding limit.

The streaming buffer is at least twice the last-level cache, so the bandwidth is DRAM's. Where the weights one
forward reads fit in the last-level cache, the timed repeats of that forward find them there (a CPU with a 480 MB
L3 holds every default row but h1024's n = 16): the step reads from the cache, the DRAM bound is no lower bound
for it, and the row is flagged `cache_resident`, with a warning.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.bench.common import hf_generate
from engine.bench.configs import BoundShape
from engine.cost.verify_curve import CachedChain


def forward_step(r: Any) -> float:
    """A target-only round's forward + its verification and commit after it (what these tables call a decode step,
    RoundStats.round_seconds before the host work before the forward and the session's were counted in it)."""
    return r.time["forward"] + r.time["sampling"]


def last_level_cache_bytes() -> int:
    """Size of this CPU's last-level cache in bytes (Linux sysfs; 0 when unknown)."""
    best_level, size = 0, 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if level >= best_level and digits.isdigit():
            best_level, size = level, int(digits) * scale
    return size


def measure_bandwidth(mb: int | None = None, repeats: int = 5) -> dict:
    """Streaming read bandwidth (B/s) of `.sum()` over `mb` MB (default: 512 MB or twice the last-level cache,
    whichever is larger: DRAM's rate), and of a large gemv (x @ W, W 64 MB stored input-major), best of `repeats`
    each; plus the FLOP rate of a large GEMM (the compute roofline) and the last-level cache size."""
    llc = last_level_cache_bytes()
    mb = mb or max(512, -(-2 * llc // 2**20))
    buf = torch.ones(mb * 2**20 // 4)
    buf.sum()
    sums = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        sums.append(time.perf_counter() - t0)
    del buf
    w = [torch.randn(2048, 4096) for _ in range(4)]  # 4 x 32 MB, cycled: none stays in cache
    x = torch.randn(1, 2048)
    x @ w[0]
    gemv = []
    for i in range(repeats * 4):
        t0 = time.perf_counter()
        x @ w[i % 4]
        gemv.append(time.perf_counter() - t0)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    a @ b
    gemm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        gemm.append(time.perf_counter() - t0)
    return {
        "stream_Bps": mb * 2**20 / min(sums),
        "gemv_Bps": w[0].numel() * 4 / min(gemv),
        "gemm_flops": 2 * 512 * 1024 * 1024 / min(gemm),
        "stream_buffer_bytes": mb * 2**20,
        "llc_bytes": llc,
    }


def make_checkpoint(shape: BoundShape, folder: Path, seed: int = 0) -> Path:
    """A random transformers checkpoint of `shape` (fp32, untied LM head) saved to folder/<name>."""
    import transformers

    skip = ("name", "model_type", "shared_expert_intermediate_size")
    kwargs = {k: v for k, v in vars(shape).items() if k not in skip}
    if shape.model_type == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = shape.shared_expert_intermediate_size
    config = transformers.AutoConfig.for_model(
        shape.model_type, tie_word_embeddings=False, max_position_embeddings=2048, **kwargs
    )
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = folder / shape.name
    hf.save_pretrained(path)
    return path


def weight_bytes(model, distinct_total: float) -> tuple[float, float]:
    """(bytes a forward reads, FLOPs per token): every dense weight, the LM head (tied or not; the embedding reads
    one row) and the experts the tokens route to, `distinct_total` = Σ_l U_l."""
    cfg = model.config
    itemsize = model.dtype.itemsize
    dense = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." not in n and "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        dense += model.lm_head.weight.numel()
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return (dense + distinct_total * expert) * itemsize, 2.0 * (dense + len(cfg.moe_layers) * cfg.top_r * expert)


@torch.inference_mode()
def _verify_times(model, n: int, context: int, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of one cached forward over n chain tokens after `context` cached ones, and U_l."""
    with CachedChain(model, context, n, seed=n) as chain:
        batch = chain.batch(n)
        out = model.forward_batch(batch, chain.kv, record_routing=True)
        distinct = [float(ids.unique().numel()) for ids in out.routing.expert_ids]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.forward_batch(batch, chain.kv)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), distinct


@torch.inference_mode()
def _hf_verify_time(hf, n: int, context: int, repeats: int) -> float:
    """transformers: median seconds of a forward over n tokens after a cached context (cache cropped back)."""
    toks = torch.randint(0, hf.config.vocab_size, (1, context + n), generator=torch.Generator().manual_seed(n))
    import transformers

    cache = transformers.DynamicCache(config=hf.config)
    hf(toks[:, :context], cache=cache, use_cache=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hf(toks[:, context:], cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-n)  # back to the context
    return statistics.median(times)


def bench_shape(path: Path, sizes: list[int], new_tokens: int, repeats: int, bw: dict, hf: bool) -> dict:
    """Decode and verification rows of one checkpoint (see the module docstring)."""
    import engine

    model = engine.load_model(path)
    ref = None
    if hf:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [torch.randint(0, model.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()]
    eng = engine.Engine(model, instrument=True, timing=False)
    routed = eng.generate(prompt, 16)[0].rounds[4:]
    decode_distinct = [statistics.mean(layer) for layer in zip(*(r.distinct_experts for r in routed))]  # [L]
    plain = engine.Engine(model, instrument=False, timing=False)
    steps, hf_s = [], []
    for _ in range(repeats):  # interleaved: ours, transformers, ours, ...
        rounds = plain.generate(prompt, new_tokens)[0].rounds
        rounds = rounds[4:] or rounds  # skip the warm-up rounds when there are enough
        steps.append(statistics.median(forward_step(r) for r in rounds))
        if ref is not None:
            t0 = time.perf_counter()
            hf_generate(ref, prompt, new_tokens)
            hf_s.append((time.perf_counter() - t0) / new_tokens)
    nbytes, flops = weight_bytes(model, sum(decode_distinct))
    step = min(steps)
    rows = [_row(1, step, nbytes, flops, bw, min(hf_s) if hf_s else None, decode_distinct)]
    for n in sizes:
        t, distinct = _verify_times(model, n, 128, max(repeats * 3, 5))
        nb, fl = weight_bytes(model, sum(distinct))
        t_hf = _hf_verify_time(ref, n, 128, max(repeats * 3, 5)) if ref is not None else None
        rows.append(_row(n, t, nb, fl * n, bw, t_hf, distinct))
    for r in rows:  # what one forward reads fits in the last-level cache: its repeats read from the cache
        r["cache_resident"] = r["weight_bytes"] <= bw.get("llc_bytes", 0)
    return {"params": sum(p.numel() for p in model.parameters()), "rows": rows}


def _row(n: int, seconds: float, nbytes: float, flops: float, bw: dict, hf_seconds: float | None, distinct) -> dict:
    read_bound = nbytes / bw["stream_Bps"]
    roof = max(read_bound, flops / bw["gemm_flops"])
    row = {
        "tokens": n,
        "seconds": seconds,
        "weight_bytes": nbytes,
        "mean_distinct_experts": statistics.mean(distinct) if distinct else 0.0,
        "bound_seconds": read_bound,
        "bound_ratio": seconds / read_bound,
        "gemv_bound_ratio": seconds / (nbytes / bw["gemv_Bps"]),
        "roofline_ratio": seconds / roof,
    }
    if hf_seconds is not None:
        row["hf_seconds"] = hf_seconds
        row["speedup_vs_hf"] = hf_seconds / seconds
    return row


def bench_bound(shapes: list[BoundShape], sizes: list[int], new_tokens: int, repeats: int, hf: bool,
                progress=None, bw: dict | None = None) -> dict:  # fmt: skip
    """Every shape's rows, with the bandwidths measured in this run (before, or `bw`, and after the shapes)."""
    bw = bw or measure_bandwidth()
    out: dict = {"bandwidth": bw, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="expertspec-bound-") as tmp:
        for shape in shapes:
            path = make_checkpoint(shape, Path(tmp))
            out["shapes"][shape.name] = bench_shape(path, sizes, new_tokens, repeats, bw, hf)
            if progress is not None:
                progress(shape.name)
    out["bandwidth_after"] = measure_bandwidth()
    resident = [f"{name} n={r['tokens']}" for name, shape in out["shapes"].items() for r in shape["rows"]
                if r["cache_resident"]]  # fmt: skip
    if resident:
        out["warnings"] = [
            f"{', '.join(resident)}: the weights each of these forwards reads fit in this CPU's "
            f"{bw['llc_bytes'] / 2**20:.0f} MB last-level cache and stay there between its timed repeats, so the DRAM "
            "streaming bound is no lower bound for these rows"
        ]
    return out
