"""Config schemas of `python -m engine.bench` (structured Hydra configs): the top level and the `cost.` group."""

from __future__ import annotations

from dataclasses import dataclass, field

ALL_SPECS = ["deepseek_v3", "qwen3_235b_a22b", "qwen3_30b_a3b", "gpt_oss_120b", "mixtral_8x7b", "olmoe_1b_7b"]


# measured phases -> roofline phases (the shared expert runs in "combine"; the roofline prices it as experts)
PHASE_GROUPS = {
    "attention": ("attention",),
    "router": ("router",),
    "experts": ("experts", "combine"),
    "other": ("embed", "mlp", "lm_head", "other"),
}


ROOFLINE_OF_GROUP = {
    "attention": ("attention",),
    "router": ("router",),
    "experts": ("expert_gemm",),
    "other": ("dispatch", "combine", "other"),
}


@dataclass
class ServeBenchConfig:
    """Settings of `python -m engine.bench serve` (engine/bench/serve.py)."""

    policies: list[str] = field(default_factory=lambda: ["none", "static-3", "learned"])
    learned_path: str | None = None  # a frozen policy folder; None: the main job's cached measured-cpu learner
    rates: list[float] = field(default_factory=lambda: [1.0, 4.0, 16.0])  # requests / second (Poisson)
    requests: int = 12  # per rate
    burst: int = 16
    max_tokens: int = 32
    timeout_s: float = 120.0  # per scenario
    max_batch: int = 16
    seed: int = 0
    plot: bool = True
    cost_hardware: str = "h200"  # the servers price rounds on this roofline profile (committed tokens per cost)


@dataclass
class PolicyBenchConfig:
    """Settings of `python -m engine.bench policy` (engine/bench/policy.py)."""

    path: str | None = None  # a frozen policy folder; None: the main job's cached AggreVaTe (seed 0) under `cost`
    cost: str = "roofline-h200-qwen3_30b_a3b"  # whose cached policy (its rounds speculate; measured-cpu's decode)
    drafter: str = "eagle-head"  # zoo names: what the main job records and trains with; or ngram (predictor=null)
    predictor: str | None = "expert-predictor"
    workloads: list[str] = field(default_factory=lambda: ["code", "prose", "chat", "math"])
    num_prompts: int = 8  # per workload
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    repeats: int = 2  # interleaved target-only / policy runs


@dataclass
class BoundShape:
    """One random checkpoint of `python -m engine.bench`'s bound table (transformers config names)."""

    name: str
    model_type: str = "qwen3_moe"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 8192
    shared_expert_intermediate_size: int = 0  # qwen2_moe only


DEFAULT_SHAPES = [
    BoundShape("h256-e16-top2", "qwen2_moe", 256, 8, 16, 2, 512, 4, 2, 8192, 1024),
    BoundShape("h512-e32-top4", "qwen3_moe", 512, 6, 32, 4, 512, 8, 2, 8192),
    BoundShape("h1024-e64-top8", "qwen3_moe", 1024, 4, 64, 8, 512, 16, 4, 8192),
]


@dataclass
class BoundBenchConfig:
    """The weight-read bound table of `python -m engine.bench` (decode mode; engine/bench/bound.py)."""

    enabled: bool = True
    shapes: list[BoundShape] = field(default_factory=lambda: list(DEFAULT_SHAPES))
    sizes: list[int] = field(default_factory=lambda: [2, 4, 8, 16])  # verification forwards of n tokens
    new_tokens: int = 32  # decode steps timed per repeat


@dataclass
class GraphsBenchConfig:
    """Settings of `python -m engine.bench graphs` (CUDA only; engine/bench/graphs.py)."""

    layers: int = 8  # of Qwen3-30B-A3B's 48 (time and memory of one check); per-layer figures scale
    new_tokens: int = 64


@dataclass
class CostBenchConfig:
    """Settings of `python -m engine.bench cost` (the `cost.` group of BenchConfig)."""

    # 1. measured
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    shapes: list[str] = field(default_factory=lambda: ["chain", "tree"])  # random drafts per repeat
    context: int = 128  # committed tokens before the root
    repeats: int = 31  # forwards per size (each with a fresh draft), medians reported
    clock: str = "auto"  # auto (cpu with one thread, else wall) | cpu (thread CPU time) | wall
    windows: int = 3  # text windows of the prompt stream (independent contexts)
    profile: bool = False
    profile_path: str | None = None  # None: <out stem>_trace.json
    profile_steps: int = 3  # profiled Engine.generate calls (n-gram drafter, K=4, W=2)
    profile_tokens: int = 8  # new tokens per profiled call (a few rounds each)
    # 2. fit
    fit_sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    fit_contexts: list[int] = field(default_factory=lambda: [32, 128, 384])
    fit_shapes: list[str] = field(default_factory=lambda: ["chain", "tree", "repeat"])
    fit_repeats: int = 21  # forwards per sample; the median is the sample's seconds
    holdout: float = 0.3  # share of samples held out of the fit
    # 3. what-if
    specs: list[str] = field(default_factory=lambda: list(ALL_SPECS))
    hardware: list[str] = field(default_factory=lambda: ["h200", "h100"])
    max_tree: int = 64  # n = 1..max_tree
    context_len: int = 1024
    samples: int = 8  # routing samples per (spec, routing)
    alphas: list[float] = field(default_factory=lambda: [0.6, 0.7, 0.8])
    draft_cost: float = 0.0  # drafter seconds per drafted token / T_AR (0: a free drafter, verification only)
    ep_world: int = 8  # EP ranks (one node); 0 = no EP variant
    ep_placement: str = "contiguous"
    ep_samples: int = 4  # EP pricing is ~30x slower (per-rank loads, all-to-all pairs)
    shared_data: str | None = None  # None: $EXPERTSPEC_SHARED_DATA, else ../shared/data (relative: repo root)
    plot: bool = True
    plot_dir: str | None = None  # None: next to the JSON output
    seed: int = 0


MODES = ("decode", "spec", "cost", "serve", "graphs", "policy")
SPEC_DRAFTERS = ("dense", "ngram", "eagle", "mtp")  # mode=spec: the zoo's drafters (eagle / mtp when trained)


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
    spec_drafters: list[str] = field(default_factory=lambda: list(SPEC_DRAFTERS))  # mode=spec: which to sweep
    out: str | None = None
    bound: BoundBenchConfig = field(default_factory=BoundBenchConfig)  # decode mode: random unseen shapes
    graphs: GraphsBenchConfig = field(default_factory=GraphsBenchConfig)  # mode=graphs (CUDA)
    cost: CostBenchConfig = field(default_factory=CostBenchConfig)  # mode=cost settings (cost.sizes=...)
    serve_bench: ServeBenchConfig = field(default_factory=ServeBenchConfig)  # mode=serve settings
    policy_bench: PolicyBenchConfig = field(default_factory=PolicyBenchConfig)  # mode=policy settings
