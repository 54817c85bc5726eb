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
target, and the target's forward cost T(n)/T(1) without a KV cache (`uncached_forward_curve`, a proxy
for the verification cost, DESIGN §8); (6) `manifest.json` and
`README.md` next to the folders. Same seed, same config, same machine: same weights. Entries other commands put
into both files (`merge_zoo_entry`: `tiny-moe-fine` of `python -m engine.zoo.fine`) are kept as they are.

`zoo_path(name)` finds a shipped folder (repo-root `zoo/`, or `$EXPERTSPEC_ZOO`). The training loops and the held-out
evaluation live in `engine/train_lm.py`; this file holds the config schema, the run and its README.

Shape letters: B=batch T=sequence length V=vocab.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from engine.cost.verify_curve import uncached_forward_curve
from engine.models.checkpoint import build_model, load_model, save_model
from engine.models.transformer import Model
from engine.paths import ZOO_NAMES as ZOO_NAMES  # re-exported
from engine.paths import zoo_path as zoo_path  # re-exported: callers use engine.zoo.build.zoo_path
from engine.zoo import corpus as corpus_lib
from engine.zoo.configs import (
    HEAD_NAMES,
    ZooConf,
    drafter_hf_config,
    target_hf_config,
)
from engine.zoo.train_heads import train_all_heads
from engine.zoo.train_lm import (
    OnStep,
    distill_drafter,
    evaluate,
    heldout_table,
    train_target,
    use_bf16_autocast,
)
from engine.zoo.train_lm import batches as batches  # re-exported: tests and callers use engine.zoo.batches


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
    verify_cost_curve: dict  # target T(n)/T(1): `uncached_forward_curve` (name kept: manifest.json key)
    checkpoint_bytes: dict
    seconds: dict
    config: dict
    machine: dict
    heads: dict = field(default_factory=dict)


def run(
    conf: ZooConf,
    out_dir: Path,
    shared_data: Path | None,
    log: Callable[[str], None] = lambda s: None,
    on_step: OnStep | None = None,
) -> ZooResult:
    """Build the zoo into `out_dir` (`tiny-moe/`, `tiny-dense/`, `manifest.json`, `README.md`); `on_step`
    follows every training step (`train_lm.train_loop`; `conf.progress` is the entry point's to read)."""
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
    target_stats = train_target(target, train_windows, conf.target, conf.seed, bf16, on_step)
    seconds["target"] = time.perf_counter() - t0

    drafter = build_model(drafter_hf_config(conf.drafter, vocab, max_pos), seed=conf.seed + 1)
    if conf.drafter.init_embeddings_from_target and conf.drafter.hidden_size == conf.target.hidden_size:
        with torch.no_grad():
            drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    t0 = time.perf_counter()
    drafter_stats = distill_drafter(drafter, target, train_windows, conf.drafter, conf.seed + 1, bf16, on_step)
    seconds["drafter"] = time.perf_counter() - t0

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        tok.save(str(tok_file))
        extra = {"tokenizer_config.json": json.dumps(tokenizer_config(max_pos), indent=2)}
        for name, model in (("tiny-moe", target), ("tiny-dense", drafter)):
            save_model(model, out_dir / name, dtype=torch.bfloat16, tokenizer_json=tok_file, extra_files=extra)

    # Report on what ships: the bf16 folders re-loaded from disk into fp32.
    t0 = time.perf_counter()
    shipped_target, shipped_drafter = load_model(out_dir / "tiny-moe"), load_model(out_dir / "tiny-dense")
    report = evaluate(shipped_target, shipped_drafter, heldout)
    curve = uncached_forward_curve(shipped_target, list(conf.curve_tokens))
    seconds["eval"] = time.perf_counter() - t0
    heads: dict = {}
    if conf.train_heads:  # on the shipped bf16 target folder, so the heads record its digest
        t0 = time.perf_counter()
        heads = train_all_heads(out_dir / "tiny-moe", out_dir, train_streams, heldout_streams, conf.heads,
                                on_step=on_step, log=log)  # fmt: skip
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
    kept, sections = _other_entries(out_dir)  # e.g. tiny-moe-fine (python -m engine.zoo.fine): kept as they are
    _write_atomic(out_dir / "manifest.json", json.dumps(asdict(result) | kept, indent=2, sort_keys=True) + "\n")
    _write_atomic(out_dir / "README.md", render_readme(result) + sections)
    return result


# ---------------------------------------------------------------------------------------------- other entries
_SECTION = "<!-- zoo entry {name}: generated by its own command, kept by python -m engine.zoo -->"
_SECTION_END = "<!-- end of zoo entry {name} -->"


def _other_entries(out_dir: Path) -> tuple[dict, str]:
    """Manifest entries that are not `ZooResult` fields, and the README sections of `merge_zoo_entry`."""
    manifest, readme = out_dir / "manifest.json", out_dir / "README.md"
    own = {f.name for f in fields(ZooResult)}
    kept = {k: v for k, v in json.loads(manifest.read_text()).items() if k not in own} if manifest.is_file() else {}
    text = readme.read_text() if readme.is_file() else ""
    start = text.find(_SECTION.split("{name}")[0])
    return kept, ("\n" + text[start:] if start >= 0 else "")


def merge_zoo_entry(out_dir: Path, name: str, entry: dict, section: str) -> None:
    """Put `entry` under `name` in `<out_dir>/manifest.json` and `section` (markdown) into `<out_dir>/README.md`
    between markers, replacing an earlier one of the same name; the rest of both files stays as it is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest, readme = out_dir / "manifest.json", out_dir / "README.md"
    data = json.loads(manifest.read_text()) if manifest.is_file() else {}
    data[name] = entry
    _write_atomic(manifest, json.dumps(data, indent=2, sort_keys=True) + "\n")
    begin, end = _SECTION.format(name=name), _SECTION_END.format(name=name)
    text = readme.read_text() if readme.is_file() else ""
    block = f"{begin}\n\n{section.strip()}\n\n{end}\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :].lstrip("\n")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block
    _write_atomic(readme, text)


def tokenizer_config(max_len: int) -> dict:
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
