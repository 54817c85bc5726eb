"""Benchmark the Triton grouped GEMM (`fused_moe`) against the torch reference and the weight-read roofline.

    python -m kernels.bench                                  # GPU: Qwen3-30B-A3B + DeepSeek-V3, bf16
    python -m kernels.bench hbm_bw=4.8e12 tokens=[8,64]      # override the detected peak bandwidth
    python -m kernels.bench tune=true                        # sweep block sizes, print JSON entries

At decode sizes the expert compute is bound by reading the active experts' weights once, so the
roofline is   t_roof = U * expert_bytes / HBM_BW,   U = distinct experts touched by the T tokens
(uniform random top-r routing). "% roof" = t_roof / t_measured = achieved bandwidth / peak.
Triton times are per call from CUDA-graph replays of `rotations` different routings (no host
launch overhead, and consecutive calls hit different experts so L2 cannot hold them); the reference
is timed eagerly. The target is >= 70 % of roofline at 8-64 tokens on H100/H200.

Without a GPU it says so and prints the same table for a tiny shape on CPU (reference only,
roofline at `cpu_bw`), which doubles as the smoke test. Hydra entry point (structured config, no YAML).
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kernels.fused_moe import MoeBlockConfig, fused_moe, fused_moe_configured, fused_moe_ref, get_config

# E=experts D=hidden F=expert dim T=tokens r=top-r U=distinct experts touched


@dataclass(frozen=True)
class ExpertShape:
    hidden: int  # D
    expert_dim: int  # F
    experts: int  # E
    top_r: int  # r

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's weights: gate+up [2F, D] and down [D, F]."""
        return 3 * self.hidden * self.expert_dim * torch.empty((), dtype=dtype).element_size()


MODELS = {
    "qwen3_30b_a3b": ExpertShape(hidden=2048, expert_dim=768, experts=128, top_r=8),
    "deepseek_v3": ExpertShape(hidden=7168, expert_dim=2048, experts=256, top_r=8),
    "cpu_tiny": ExpertShape(hidden=256, expert_dim=128, experts=16, top_r=2),
}
# peak HBM bandwidth (B/s) by device-name substring; first match wins
PEAK_HBM_BW = {"H200": 4.8e12, "H100": 3.35e12}
DEFAULT_HBM_BW = 3.35e12


@dataclass
class BenchConfig:
    models: list[str] = field(default_factory=lambda: ["qwen3_30b_a3b", "deepseek_v3"])
    tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    dtype: str = "bfloat16"
    hbm_bw: float | None = None  # B/s; None = from the device name (H100 3.35e12, H200 4.8e12)
    iters: int = 20  # graph replays (Triton) / calls (reference) per measurement
    rotations: int = 8  # distinct routings per timed call sequence
    reference: bool = True  # also time the torch reference
    tune: bool = False  # sweep block sizes and print fused_moe_configs.json entries
    seed: int = 0
    # CPU sanity table (no GPU): tiny shape, fp32, roofline at one thread's memory bandwidth
    cpu_models: list[str] = field(default_factory=lambda: ["cpu_tiny"])
    cpu_bw: float = 14e9


ConfigStore.instance().store(name="kernels_bench_schema", node=BenchConfig)
# The primary config: the schema, run where started with no output folder and quiet Hydra logging (as the
# engine entry points, engine/cli.py); any hydra.run.dir=... / hydra/job_logging=... override still wins.
ConfigStore.instance().store(
    name="kernels_bench",
    node={
        "defaults": [
            "kernels_bench_schema",
            "_self_",
            {"override hydra/job_logging": "disabled"},
            {"override hydra/hydra_logging": "disabled"},
        ],
        "hydra": {"run": {"dir": "."}, "output_subdir": None},
    },
)


@dataclass
class Case:
    """One routing sample: inputs for a call and the bytes its distinct experts weigh."""

    hidden: torch.Tensor  # [T, D]
    expert_ids: torch.Tensor  # [T, r]
    topk_weights: torch.Tensor  # [T, r]
    bytes_read: int


def make_weights(shape: ExpertShape, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random expert weights w_gate_up [E, 2F, D], w_down [E, D, F] (scaled so outputs stay O(1))."""
    D, F, E = shape.hidden, shape.expert_dim, shape.experts
    w_gate_up = torch.randn(E, 2 * F, D, dtype=dtype, device=device).mul_(D**-0.5)
    w_down = torch.randn(E, D, F, dtype=dtype, device=device).mul_(F**-0.5)
    return w_gate_up, w_down


def make_case(shape: ExpertShape, T: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> Case:
    """Uniform random top-r routing of T tokens (distinct experts per token), softmax weights."""
    scores = torch.rand(T, shape.experts, generator=gen)
    expert_ids = scores.topk(shape.top_r, dim=1).indices  # [T, r]
    topk_weights = torch.softmax(torch.randn(T, shape.top_r, generator=gen), dim=1)
    hidden = torch.randn(T, shape.hidden, generator=gen).to(dtype)
    touched = expert_ids.unique().numel()
    return Case(
        hidden.to(device),
        expert_ids.to(device),
        topk_weights.to(device),
        touched * shape.expert_bytes(dtype),
    )


def time_graph(fns: list[Callable[[], torch.Tensor]], iters: int) -> tuple[float, str]:
    """Seconds per call of `fns` (run in sequence), from CUDA-graph replays; eager if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) off the default stream, as capture requires
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        graph.replay()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        mode = "graph"
    except RuntimeError:  # capture unsupported here: fall back to eager (includes launch overhead)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            for fn in fns:
                fn()
        end.record()
        mode = "eager"
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * len(fns)), mode


def time_eager(fns: list[Callable[[], torch.Tensor]], iters: int, cuda: bool) -> float:
    """Seconds per call of `fns` run eagerly (wall clock; synchronised on CUDA)."""
    for fn in fns:
        fn()
    if cuda and torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        for fn in fns:
            fn()
    if cuda and torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * len(fns))


HEADER = (
    f"{'model':<14} {'T':>3} {'U':>5} {'MB read':>9} {'roof us':>8} {'triton us':>10} {'% roof':>7} "
    f"{'GB/s':>7} {'torch us':>9} {'% roof':>7} {'speedup':>8} {'max err':>8}"
)


def row(
    model: str,
    T: int,
    U: float,
    nbytes: float,
    bw: float,
    t_tri: float | None,
    t_ref: float | None,
    err: float | None,
) -> str:
    """One table line; times in seconds, None prints n/a."""
    t_roof = nbytes / bw
    na = "n/a"
    tri = (
        f"{t_tri * 1e6:10.1f} {t_roof / t_tri:7.1%} {nbytes / t_tri / 1e9:7.0f}"
        if t_tri
        else f"{na:>10} {na:>7} {na:>7}"
    )
    ref = f"{t_ref * 1e6:9.1f} {t_roof / t_ref:7.1%}" if t_ref else f"{na:>9} {na:>7}"
    speedup = f"{t_ref / t_tri:7.2f}x" if t_ref and t_tri else f"{na:>8}"
    err_s = f"{err:8.1e}" if err is not None else f"{na:>8}"
    head = f"{model:<14} {T:>3} {U:>5.1f} {nbytes / 1e6:>9.1f} {t_roof * 1e6:>8.1f}"
    return f"{head} {tri} {ref} {speedup} {err_s}"


def bind(
    cases: list[Case],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    fn: Callable[..., torch.Tensor] = fused_moe,
    config: MoeBlockConfig | None = None,
) -> list[Callable[[], torch.Tensor]]:
    """One zero-argument call of `fn` (or `fused_moe_configured` with `config`) per routing case."""
    if config is not None:
        fn = functools.partial(fused_moe_configured, config=config)
    return [functools.partial(fn, c.hidden, w_gate_up, w_down, c.expert_ids, c.topk_weights) for c in cases]


def run_cpu(cfg: BenchConfig) -> None:
    """Reference-only sanity table on CPU (tiny shapes, fp32, one thread)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(cfg.seed)
    print(f"CPU sanity table: torch reference only, fp32, 1 thread, roofline at cpu_bw={cfg.cpu_bw:.3g} B/s")
    print(HEADER)
    for model in cfg.cpu_models:
        shape = MODELS[model]
        w_gate_up, w_down = make_weights(shape, torch.float32, "cpu")
        for T in cfg.tokens:
            cases = [make_case(shape, T, torch.float32, "cpu", gen) for _ in range(cfg.rotations)]
            t_ref = time_eager(bind(cases, w_gate_up, w_down, fused_moe_ref), cfg.iters, cuda=False)
            nbytes = sum(c.bytes_read for c in cases) / len(cases)
            U = nbytes / shape.expert_bytes(torch.float32)
            print(row(model, T, U, nbytes, cfg.cpu_bw, None, t_ref, None))


def tune_grid(T: int) -> list[MoeBlockConfig]:
    """Candidate block sizes for `tune=true` (BLOCK_M beyond 16 only pays with many rows per expert)."""
    block_m = [16] if T <= 32 else [16, 32]
    grid = itertools.product(block_m, [32, 64, 128], [64, 128, 256], [4, 8], [3, 4, 5])
    return [MoeBlockConfig(m, n, k, w, s) for m, n, k, w, s in grid]


def run_gpu(cfg: BenchConfig, device: str = "cuda") -> None:
    """The GPU table (and, with `tune`, the block-size sweep) for every model shape and token count."""
    dtype = getattr(torch, cfg.dtype)
    device_name = torch.cuda.get_device_name() if device == "cuda" else device
    bw = cfg.hbm_bw or next((v for k, v in PEAK_HBM_BW.items() if k in device_name), None)
    if bw is None:
        bw = DEFAULT_HBM_BW
        print(f"unknown GPU {device_name!r}: assuming H100 HBM bandwidth; pass hbm_bw=<B/s> to override")
    print(f"device {device_name}, peak HBM bandwidth {bw:.3g} B/s, {cfg.dtype}, {cfg.rotations} routings")
    gen = torch.Generator().manual_seed(cfg.seed)
    tuned = []
    print(HEADER)
    for model in cfg.models:
        shape = MODELS[model]
        w_gate_up, w_down = make_weights(shape, dtype, device)
        for T in cfg.tokens:
            cases = [make_case(shape, T, dtype, device, gen) for _ in range(cfg.rotations)]
            nbytes = sum(c.bytes_read for c in cases) / len(cases)
            U = nbytes / shape.expert_bytes(dtype)
            t_tri, mode = time_graph(bind(cases, w_gate_up, w_down), cfg.iters)
            if mode != "graph":
                print(f"(graph capture failed for T={T}: eager timing, includes launch overhead)")
            out = bind(cases[:1], w_gate_up, w_down, fused_moe)[0]().float()
            ref = bind(cases[:1], w_gate_up, w_down, fused_moe_ref)[0]().float()
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            t_ref = None
            if cfg.reference:
                t_ref = time_eager(bind(cases, w_gate_up, w_down, fused_moe_ref), max(1, cfg.iters // 4), cuda=True)
            print(row(model, T, U, nbytes, bw, t_tri, t_ref, err), flush=True)
            if cfg.tune:
                tuned.append(tune(shape, T, cases, w_gate_up, w_down, nbytes / bw, cfg.iters))
        del w_gate_up, w_down
        torch.cuda.empty_cache()
    if tuned:
        print("fused_moe_configs.json entries for this GPU (paste into kernels/fused_moe_configs.json):")
        print(json.dumps({"configs": tuned}, indent=1))


def tune(
    shape: ExpertShape,
    T: int,
    cases: list[Case],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    t_roof: float,
    iters: int,
) -> dict:
    """Time every config of `tune_grid(T)`; print the best and return it as a JSON config entry."""
    timed = []
    for config in tune_grid(T):
        try:
            timed.append((time_graph(bind(cases, w_gate_up, w_down, config=config), max(3, iters // 4))[0], config))
        except Exception as exc:  # e.g. out of shared memory for the largest tiles
            print(f"  skip {config}: {type(exc).__name__}")
    best_t, best = min(timed, key=lambda x: x[0])
    default = get_config(T, shape.hidden, shape.expert_dim)
    print(f"  tuned {best}: {best_t * 1e6:.1f} us ({t_roof / best_t:.1%} roof); current {default}")
    return {"hidden": shape.hidden, "expert_dim": shape.expert_dim, "max_tokens": T, **asdict(best)}


@hydra.main(version_base=None, config_name="kernels_bench")
def main(cfg: BenchConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    unknown = [m for m in [*cfg.models, *cfg.cpu_models] if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model shapes {unknown}; known: {sorted(MODELS)}")
    torch.manual_seed(cfg.seed)
    if torch.cuda.is_available():
        run_gpu(cfg)
    else:
        print("No CUDA GPU present: the Triton grouped GEMM is not timed; GPU figures are pending.")
        run_cpu(cfg)


if __name__ == "__main__":
    main()
