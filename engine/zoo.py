"""Train the shipped tiny models: an MoE target (`zoo/tiny-moe`) and a dense drafter (`zoo/tiny-dense`).

    python -m engine.zoo                                  # the default run (~20 min on 2 cores) -> zoo/
    python -m engine.zoo +experiment=zoo_smoke            # < 1 min, tiny sizes, into a temp folder
    python -m engine.zoo out_dir=/tmp/zoo seed=1 target.train.steps=2000 corpus.shared_data=/data

Stages: (1) corpus from the Python standard library and `pydoc_data.topics` (plus `../shared/data`
when present, see `engine/corpus.py`), split by document-name hash; (2) a byte-level BPE tokenizer;
(3) a `qwen2_moe` target trained with cross-entropy + the load-balancing aux loss (AdamW, warmup +
cosine); (4) a dense `qwen2` drafter distilled from the target with KL(target || drafter) + a little
cross-entropy; (5) both saved as HF folders (bf16, tokenizer.json in each) and re-loaded from disk for
the held-out report: nats/token and perplexity per corpus, the drafter's top-1 agreement with the
target, and the target's verification cost curve T(n)/T(1) (DESIGN §8); (6) `manifest.json` and
`README.md` next to the folders. Same seed, same config, same machine: same weights.

`zoo_path(name)` finds a shipped folder (repo-root `zoo/`, or `$EXPERTSPEC_ZOO`). The training loops and the held-out
evaluation live in `engine/train_lm.py`; this file holds the config schema, the run and its README.

Shape letters: B=batch T=sequence length V=vocab.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf
from tqdm import tqdm

from . import corpus as corpus_lib
from .checkpoint import build_model, load_model, save_model
from .model import Model
from .train_heads import HEAD_NAMES, TrainHeadsConf, train_all_heads
from .train_lm import batches as batches  # re-exported: tests and callers use engine.zoo.batches
from .train_lm import distill_drafter, evaluate, heldout_table, train_target, use_bf16_autocast, verify_cost_curve

REPO_ROOT = Path(__file__).resolve().parents[1]
ZOO_NAMES = ("tiny-moe", "tiny-dense")


def zoo_path(name: str = "tiny-moe") -> Path:
    """The shipped checkpoint folder `name` under repo-root `zoo/` (or `$EXPERTSPEC_ZOO`)."""
    root = Path(os.environ.get("EXPERTSPEC_ZOO") or REPO_ROOT / "zoo")
    path = root / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"zoo checkpoint {name!r} not found at {path}: build the zoo with `python -m engine.zoo` "
            f"(about 20 minutes on 2 CPU cores; known names: {', '.join(ZOO_NAMES)}), "
            "or point EXPERTSPEC_ZOO at a folder that holds it"
        )
    return path


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


ConfigStore.instance().store(name="zoo_schema", node=ZooConf)


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


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class ZooResult:
    """What a run produced (also written to `manifest.json`)."""

    out_dir: str
    seed: int
    autocast_bf16: bool
    shared_data_used: bool
    corpus_sizes: dict
    token_counts: dict
    tokenizer: dict
    target: dict
    drafter: dict
    heldout: dict
    verify_cost_curve: dict
    checkpoint_bytes: dict
    seconds: dict
    config: dict
    machine: dict
    heads: dict = field(default_factory=dict)


def run(
    conf: ZooConf, out_dir: Path, shared_data: Path | None, log: Callable[[str], None] = lambda s: None
) -> ZooResult:
    """Build the zoo into `out_dir` (`tiny-moe/`, `tiny-dense/`, `manifest.json`, `README.md`)."""
    wall0 = time.perf_counter()
    seconds: dict[str, float] = {}
    torch.set_num_threads(conf.threads)
    torch.manual_seed(conf.seed)
    bf16 = use_bf16_autocast(conf.autocast)
    have_shared = shared_data is not None and (shared_data / "corpus").is_dir()

    t0 = time.perf_counter()
    split = corpus_lib.assemble_corpus(
        shared_data if have_shared else None,
        conf.corpus.heldout_fraction,
        conf.corpus.chunk_chars,
        dict(conf.corpus.train_chars),
        dict(conf.corpus.heldout_chars),
    )
    seconds["corpus"] = time.perf_counter() - t0
    log(f"corpus: {split.sizes()} (shared data: {shared_data if have_shared else 'absent'})")

    t0 = time.perf_counter()
    tok_texts = [
        d.text
        for c in split.corpora
        for d in corpus_lib.cap_documents(split.train.get(c, []), conf.tokenizer.train_chars)
    ]
    tok = corpus_lib.train_tokenizer(tok_texts, conf.tokenizer.vocab_size, conf.tokenizer.min_frequency)
    vocab = tok.get_vocab_size()
    train_streams = {c: corpus_lib.encode_stream(tok, split.train.get(c, [])) for c in split.corpora}
    heldout_streams = {c: corpus_lib.encode_stream(tok, split.heldout.get(c, [])) for c in split.corpora}
    seconds["tokenizer"] = time.perf_counter() - t0
    T1 = conf.seq_len + 1
    train_windows = torch.cat([corpus_lib.windows(s, T1) for s in train_streams.values()])  # [W, T+1]
    heldout = {
        c: corpus_lib.windows(s, T1, max(1, conf.eval_tokens // conf.seq_len)) for c, s in heldout_streams.items()
    }
    heldout = {c: w for c, w in heldout.items() if w.shape[0]}
    token_counts = {
        c: {"train": train_streams[c].numel(), "heldout": heldout_streams[c].numel(),
            "heldout_chars_per_token": split.sizes()[c]["heldout_chars"] / max(1, heldout_streams[c].numel())}
        for c in split.corpora
    }  # fmt: skip
    log(f"tokenizer: vocab {vocab}; train windows {train_windows.shape[0]} x {T1} tokens")

    max_pos = max(conf.target.max_position_embeddings, conf.seq_len)
    target = build_model(target_hf_config(conf.target, vocab), seed=conf.seed)
    t0 = time.perf_counter()
    target_stats = train_target(target, train_windows, conf.target, conf.seed, bf16, conf.progress)
    seconds["target"] = time.perf_counter() - t0

    drafter = build_model(drafter_hf_config(conf.drafter, vocab, max_pos), seed=conf.seed + 1)
    if conf.drafter.init_embeddings_from_target and conf.drafter.hidden_size == conf.target.hidden_size:
        with torch.no_grad():
            drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    t0 = time.perf_counter()
    drafter_stats = distill_drafter(drafter, target, train_windows, conf.drafter, conf.seed + 1, bf16, conf.progress)
    seconds["drafter"] = time.perf_counter() - t0

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        tok.save(str(tok_file))
        extra = {"tokenizer_config.json": json.dumps(_tokenizer_config(max_pos), indent=2)}
        for name, model in (("tiny-moe", target), ("tiny-dense", drafter)):
            save_model(model, out_dir / name, dtype=torch.bfloat16, tokenizer_json=tok_file, extra_files=extra)

    # Report on what ships: the bf16 folders re-loaded from disk into fp32.
    t0 = time.perf_counter()
    shipped_target, shipped_drafter = load_model(out_dir / "tiny-moe"), load_model(out_dir / "tiny-dense")
    report = evaluate(shipped_target, shipped_drafter, heldout)
    curve = verify_cost_curve(shipped_target, list(conf.curve_tokens))
    seconds["eval"] = time.perf_counter() - t0
    heads: dict = {}
    if conf.train_heads:  # on the shipped bf16 target folder, so the heads record its digest
        t0 = time.perf_counter()
        heads = train_all_heads(out_dir / "tiny-moe", out_dir, train_streams, heldout_streams, conf.heads,
                                progress=conf.progress, log=log)  # fmt: skip
        seconds["heads"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - wall0

    result = ZooResult(
        out_dir=str(out_dir),
        seed=conf.seed,
        autocast_bf16=bf16,
        shared_data_used=have_shared,
        corpus_sizes=split.sizes(),
        token_counts=token_counts,
        tokenizer={"vocab_size": vocab, "special_tokens": list(corpus_lib.SPECIAL_TOKENS)},
        target={**target_stats, "params": _num_params(target), "hf_config": target.config.raw},
        drafter={**drafter_stats, "params": _num_params(drafter), "hf_config": drafter.config.raw},
        heldout=report,
        verify_cost_curve=curve,
        checkpoint_bytes={n: _folder_bytes(out_dir / n) for n in ZOO_NAMES + (HEAD_NAMES if heads else ())},
        heads=heads,
        seconds=seconds,
        config=asdict(conf),
        machine={"python": platform.python_version(), "torch": torch.__version__, "threads": conf.threads},
    )
    _write_atomic(out_dir / "manifest.json", json.dumps(asdict(result), indent=2, sort_keys=True) + "\n")
    _write_atomic(out_dir / "README.md", render_readme(result))
    return result


def _tokenizer_config(max_len: int) -> dict:
    """Lets `transformers.AutoTokenizer` load the folder's tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": corpus_lib.EOS_TOKEN,
        "bos_token": corpus_lib.EOS_TOKEN,
        "pad_token": corpus_lib.PAD_TOKEN,
        "model_max_length": max_len,
    }


def _num_params(model: Model) -> int:
    return sum(p.numel() for p in model.parameters())


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def render_readme(r: ZooResult) -> str:
    """`zoo/README.md`: what the folders are, how they were made, and the held-out numbers."""
    t, d = r.target["hf_config"], r.drafter["hf_config"]
    lines = [
        "# zoo: tiny models trained by `python -m engine.zoo`",
        "",
        "Generated file; rebuild with `python -m engine.zoo` (same seed and machine: same weights).",
        "",
        f"- `tiny-moe/`: `qwen2_moe` target, hidden {t['hidden_size']}, {t['num_hidden_layers']} layers, "
        f"{t['num_experts']} experts top-{t['num_experts_per_tok']}, dim {t['moe_intermediate_size']}, "
        f"shared expert {t['shared_expert_intermediate_size']}, vocab {t['vocab_size']}, "
        f"{r.target['params'] / 1e6:.2f} M params, {r.checkpoint_bytes['tiny-moe'] / 1e6:.1f} MB (bf16)",
        f"- `tiny-dense/`: `{d['model_type']}` drafter distilled from the target, hidden {d['hidden_size']}, "
        f"{d['num_hidden_layers']} layers, intermediate {d['intermediate_size']}, "
        f"{r.drafter['params'] / 1e6:.2f} M params, {r.checkpoint_bytes['tiny-dense'] / 1e6:.1f} MB (bf16)",
        f"- seed {r.seed}; bf16 autocast {r.autocast_bf16}; shared data used: {r.shared_data_used}; "
        f"target {r.target['steps']} steps, drafter {r.drafter['steps']} steps; "
        f"wall time {r.seconds['total'] / 60:.1f} min",
        "",
        "Held-out text (fp32 forward of the shipped bf16 weights):",
        "",
        heldout_table(r.heldout),
    ]
    if r.heads:
        e, m, p = r.heads["eagle"], r.heads["mtp"], r.heads["expert_predictor"]
        lines += [
            "",
            f"- `eagle-head/`: EAGLE feature head, top-1 agreement with the target {e['eagle_top1_agreement']:.3f}",
            f"- `mtp-head/`: MTP module, t+2 top-1 accuracy {m['mtp_top1_accuracy_t2']:.3f}, "
            f"agreement with the target's t+2 argmax {m['mtp_top1_agreement_t2']:.3f}",
            f"- `expert-predictor/`: top-r recall per MoE layer {p['topr_recall_per_layer']} "
            f"(random {p['random_baseline']:.3f})",
        ]
    curve = ", ".join(f"{k} {v:.2f}" for k, v in r.verify_cost_curve.items() if not k.startswith("ms_"))
    lines += [
        "",
        f"Target verification cost T(n)/T(1) (plain forward, 1 thread, no KV prefix): {curve}.",
        "",
        "Corpus characters per side:",
        "",
        "```json",
        json.dumps(r.corpus_sizes, indent=2),
        "```",
        "",
        "Full configuration, token counts and timings: `manifest.json`.",
        "",
    ]
    return "\n".join(lines)


def _resolve_shared(path: str) -> Path | None:
    if not path:
        return None
    p = Path(path).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


@hydra.main(config_path="../conf", config_name="zoo", version_base=None)
def main(cfg) -> None:
    conf: ZooConf = OmegaConf.to_object(cfg)
    out_dir = Path(to_absolute_path(conf.out_dir))
    shared = _resolve_shared(conf.corpus.shared_data)
    result = run(conf, out_dir, shared, log=tqdm.write)
    print(f"\nheld-out (shipped bf16 weights, fp32 forward) -> {out_dir}\n")
    print(heldout_table(result.heldout))
    curve = ", ".join(f"{k} {v:.2f}" for k, v in result.verify_cost_curve.items() if not k.startswith("ms_"))
    print(f"\ntarget T(n)/T(1): {curve}")
    print(f"checkpoints (bytes): {result.checkpoint_bytes}")
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result.seconds.items())
    print(f"wall time: {result.seconds['total'] / 60:.1f} min ({phases})")


if __name__ == "__main__":
    main()
