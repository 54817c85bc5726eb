"""Config schemas of the zoo: the tiny target and drafter, their training, the heads, the HF config dicts.

Plain dataclasses (Hydra structured configs: `python -m engine.zoo` and `python -m engine.zoo.train_heads`
register them); library code takes them as typed arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hydra.core.config_store import ConfigStore

HEAD_NAMES = ("eagle-head", "mtp-head", "expert-predictor")


# ---------------------------------------------------------------------------------------------- config
@dataclass
class HeadTrainConf:
    """AdamW, linear warmup, cosine decay to min_lr_ratio * lr (the fields of engine.zoo.TrainConf)."""

    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass
class EagleConf:
    intermediate_size: int = 512
    reg_weight: float = 1.0  # smooth-L1 feature regression
    cls_weight: float = 0.1  # CE against the target's distribution
    feature_noise: float = 0.1  # U(-a, a) added to input features (EAGLE's robustness to drafted features)
    loss_fraction: float = 0.25  # share of positions (random per step) whose CE goes through the lm_head
    train: HeadTrainConf = field(default_factory=HeadTrainConf)


@dataclass
class MTPConf:
    intermediate_size: int = 512
    # + weight * CE against the target's law of x_{t+2} (distillation for drafting; 0 = the paper's loss). On
    # zoo/tiny-moe it lifts agreement with the target from 0.56 to 0.65 at equal text accuracy.
    target_kl_weight: float = 1.0
    loss_fraction: float = 0.25  # share of positions (random per step) whose CE goes through the lm_head
    train: HeadTrainConf = field(default_factory=HeadTrainConf)


@dataclass
class PredictorConf:
    hidden_size: int = 256
    # optional HF folder of a dense drafter (e.g. zoo/tiny-dense): also train a predictor on its final hidden
    # states -> <out_dir>/expert-predictor-dense (input "dense", for a ModelDrafter with the predictor hook)
    dense_drafter: str = ""
    train: HeadTrainConf = field(default_factory=lambda: HeadTrainConf(steps=400, batch_size=1024, lr=3e-3))


@dataclass
class DataConf:
    """Corpus split as engine.zoo makes it (same fraction and chunking: same held-out documents)."""

    shared_data: str = "${oc.env:EXPERTSPEC_SHARED_DATA,../shared/data}"  # relative: to the repo root
    heldout_fraction: float = 0.1
    chunk_chars: int = 8192
    train_chars: dict[str, int] = field(
        default_factory=lambda: {"code": 600_000, "english": -1, "prose": 300_000, "docs": 300_000}
    )
    heldout_chars: dict[str, int] = field(
        default_factory=lambda: {"code": 300_000, "english": -1, "prose": 300_000, "docs": 300_000}
    )
    seq_len: int = 256
    train_windows: int = 1200  # cap on training windows (a seeded random subset)
    eval_tokens: int = 8192  # held-out tokens per corpus


@dataclass
class EvalConf:
    """Greedy speculative decoding through engine.Engine on held-out prompts: acceptance length τ and
    expert footprint for a chain (K, 1), a tree (K, W, frontier), and the same tree cut to max_verify
    nodes by path probability (λ = 0) and by EcoSpec's expert-aware score (λ = lam)."""

    prompts: int = 8
    prompt_len: int = 32
    new_tokens: int = 48
    depth: int = 4
    width: int = 2
    frontier: int = 4
    max_verify: int = 6
    lam: float = 1.0


@dataclass
class TrainHeadsConf:
    target: str = ""  # HF folder of the MoE target; "" = engine.zoo.zoo_path("tiny-moe")
    out_dir: str = "zoo"  # relative: to the directory the command was started from
    seed: int = 0
    threads: int = 1  # 2 threads lose badly to 1 when other jobs share the 2 cores
    smoke: bool = False  # random tiny target, byte tokens, tiny budgets, temp out_dir (see `smoke_conf`)
    progress: bool = True
    data: DataConf = field(default_factory=DataConf)
    eagle: EagleConf = field(default_factory=EagleConf)
    mtp: MTPConf = field(default_factory=MTPConf)
    predictor: PredictorConf = field(default_factory=PredictorConf)
    eval: EvalConf = field(default_factory=EvalConf)


def smoke_conf(conf: TrainHeadsConf) -> TrainHeadsConf:
    """The `smoke=true` budgets: seconds, not minutes (the test of the entry point)."""
    tiny = HeadTrainConf(steps=60, batch_size=8, lr=3e-3, warmup_steps=4)
    return replace(
        conf,
        data=replace(conf.data, seq_len=64, train_windows=96, eval_tokens=1024),
        eagle=replace(conf.eagle, intermediate_size=64, train=tiny),
        mtp=replace(conf.mtp, intermediate_size=64, train=tiny),
        predictor=replace(conf.predictor, hidden_size=64, train=HeadTrainConf(steps=150, batch_size=256)),
        eval=replace(conf.eval, prompts=2, prompt_len=16, new_tokens=16),
    )


# ---------------------------------------------------------------------------------------------- config
@dataclass
class TrainConf:
    """Optimiser and schedule of one model: AdamW, linear warmup, cosine decay to min_lr_ratio * lr."""

    steps: int = 1000
    batch_size: int = 8  # at a fixed budget, more updates beat bigger batches for these tiny models
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass
class CorpusConf:
    """Sources, split and caps (characters; -1 = no cap). See `engine/corpus.py`."""

    shared_data: str = "${oc.env:EXPERTSPEC_SHARED_DATA,../shared/data}"  # relative: to the repo root
    heldout_fraction: float = 0.1
    chunk_chars: int = 8192
    train_chars: dict[str, int] = field(
        default_factory=lambda: {"code": 6_000_000, "english": -1, "prose": 3_000_000, "docs": 4_000_000}
    )
    heldout_chars: dict[str, int] = field(
        default_factory=lambda: {"code": 300_000, "english": -1, "prose": 300_000, "docs": 300_000}
    )


@dataclass
class TokenizerConf:
    vocab_size: int = 4096
    min_frequency: int = 2
    train_chars: int = 2_000_000  # per corpus, from the train side only


@dataclass
class TargetConf:
    """The `qwen2_moe` target (shared expert with sigmoid gate)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 16
    top_r: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.01
    max_position_embeddings: int = 1024
    train: TrainConf = field(default_factory=lambda: TrainConf(steps=800))


@dataclass
class DrafterConf:
    """The dense drafter, distilled from the target: kl_weight * KL(target || drafter) + ce_weight * CE."""

    model_type: str = "qwen2"  # or "llama"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    kl_weight: float = 1.0
    ce_weight: float = 0.1
    init_embeddings_from_target: bool = True  # copy the target's (tied) embeddings when the widths match
    train: TrainConf = field(default_factory=lambda: TrainConf(steps=500))


@dataclass
class ZooConf:
    out_dir: str = "zoo"  # relative: to the directory the command was started from
    seed: int = 0
    seq_len: int = 256
    threads: int = 1  # 2 threads: 1.5x faster on an idle 2-core machine, ~10x slower on a shared one
    autocast: str = "auto"  # "auto" (bf16 iff the CPU has native bf16 dot products) | "bf16" | "off"
    eval_tokens: int = 8192  # per corpus, held-out side
    curve_tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    progress: bool = True
    corpus: CorpusConf = field(default_factory=CorpusConf)
    tokenizer: TokenizerConf = field(default_factory=TokenizerConf)
    target: TargetConf = field(default_factory=TargetConf)
    drafter: DrafterConf = field(default_factory=DrafterConf)
    heads: TrainHeadsConf = field(default_factory=TrainHeadsConf)  # EAGLE / MTP heads, expert predictor
    train_heads: bool = True


# ---------------------------------------------------------------------------------------------- fine-grained
@dataclass
class FineTargetConf:
    """The fine-grained `deepseek_v3` target (`python -m engine.zoo.fine`): multi-head latent attention, 64
    routed experts top-6 plus one shared expert of the same size, DeepSeek-V3's sigmoid router with a correction
    bias and group-limited choice, the first `first_k_dense_replace` layers dense (SwiGLU of intermediate_size).

    Expert dim / hidden = 32 / 128 = 0.25 (DeepSeek-V3: 2048 / 7168 = 0.29). Balancing is DeepSeek-V3's
    (2412.19437 §2.1.2): no auxiliary loss on the router; after every step each expert's correction bias moves
    by bias_update_speed towards the mean load (2408.15664), plus a tiny sequence-wise balance loss."""

    name: str = "tiny-moe-fine"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    q_lora_rank: int = 0  # 0: q_proj (DeepSeek-V2-Lite style); > 0: q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    num_experts: int = 64
    top_r: int = 6
    n_group: int = 8
    topk_group: int = 4
    moe_intermediate_size: int = 32
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    intermediate_size: int = 1024  # the dense layers' SwiGLU
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # u of the auxiliary-loss-free balancing. DeepSeek-V3's 0.001 (a long run at a low learning rate) is too slow for
    # 800 steps at lr 3e-3: max / mean expert load reached 8.5 by step 60; 0.01 brings it to ~2 by step 200
    bias_update_speed: float = 0.01
    seq_aux_loss_coef: float = 1e-4  # alpha of the complementary sequence-wise balance loss (DeepSeek-V3: 0.0001)
    max_position_embeddings: int = 1024
    train: TrainConf = field(default_factory=lambda: TrainConf(steps=800))


@dataclass
class FineMTPConf:
    """The target's own MTP module (DeepSeek-V3 layout, layer num_hidden_layers, one MLA + MoE block) trained on
    the frozen target: CE(x_{t+2}) + target_kl_weight * CE against the target's law of x_{t+2}. It reads the
    target's (tied) embedding and output head, so the checkpoint ships no copies of them."""

    target_kl_weight: float = 1.0
    loss_fraction: float = 0.25  # share of positions (random per step) whose CE goes through the output head
    train_windows: int = 1200  # cap on training windows (a seeded random subset)
    train: HeadTrainConf = field(default_factory=lambda: HeadTrainConf(steps=300, batch_size=16))


@dataclass
class FineEvalConf:
    """The report: per built-in workload (engine.workloads) greedy paths of both targets and MTP acceptance."""

    workloads: list[str] = field(default_factory=lambda: ["code", "prose", "chat", "math"])
    prompts: int = 8  # per workload
    max_prompt_tokens: int = 128
    new_tokens: int = 64
    mtp_depth: int = 3  # K of the MTP chain (greedy)
    distinct_tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])


@dataclass
class FineZooConf:
    out_dir: str = "zoo"  # relative: to the directory the command was started from
    seed: int = 0
    seq_len: int = 256
    threads: int = 1
    autocast: str = "auto"  # as ZooConf.autocast
    eval_tokens: int = 8192  # per corpus, held-out side
    curve_tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    progress: bool = True
    tokenizer: str = "zoo/tiny-moe/tokenizer.json"  # reused, so traces of both targets share token ids
    compare_with: str = "zoo/tiny-moe"  # also measured in the same run for the side-by-side report ("" = none)
    corpus: CorpusConf = field(default_factory=CorpusConf)
    target: FineTargetConf = field(default_factory=FineTargetConf)
    mtp: FineMTPConf = field(default_factory=FineMTPConf)
    eval: FineEvalConf = field(default_factory=FineEvalConf)


# Fields shared by both configs: SiLU, default RoPE, tied embeddings, <|endoftext|> = 0 = bos/eos, <|pad|> = 1.
_HF_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1)  # fmt: skip


def target_hf_config(c: TargetConf, vocab_size: int) -> dict:
    """HF `config.json` dict of the target (every layer sparse, shared expert with sigmoid gate)."""
    return dict(
        _HF_COMMON,
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.shared_expert_intermediate_size,  # unused: no dense layers
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        num_experts=c.num_experts,
        num_experts_per_tok=c.top_r,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=c.router_aux_loss_coef,
        output_router_logits=False,
        max_position_embeddings=c.max_position_embeddings,
    )


def fine_target_hf_config(c: FineTargetConf, vocab_size: int) -> dict:
    """HF `config.json` dict of the fine-grained `deepseek_v3` target, one MTP module declared (its weights are
    added by `engine.zoo.train_fine.save_with_mtp`)."""
    return dict(
        {k: v for k, v in _HF_COMMON.items() if k != "use_sliding_window"},
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_heads,
        q_lora_rank=c.q_lora_rank or None,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rope_interleave=True,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.top_r,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        first_k_dense_replace=c.first_k_dense_replace,
        routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=c.norm_topk_prob,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=1,
        attention_bias=False,
        max_position_embeddings=c.max_position_embeddings,
    )


def drafter_hf_config(c: DrafterConf, vocab_size: int, max_positions: int) -> dict:
    """HF `config.json` dict of the dense drafter."""
    if c.model_type not in ("qwen2", "llama"):
        raise ValueError(f"drafter.model_type must be 'qwen2' or 'llama', got {c.model_type!r}")
    return dict(
        _HF_COMMON,
        model_type=c.model_type,
        architectures=["Qwen2ForCausalLM" if c.model_type == "qwen2" else "LlamaForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=max_positions,
    )


ConfigStore.instance().store(name="zoo_schema", node=ZooConf)
ConfigStore.instance().store(name="train_heads_schema", node=TrainHeadsConf)
ConfigStore.instance().store(name="zoo_fine_schema", node=FineZooConf)
