"""`python -m engine.zoo.fine`: the fine-grained zoo target `zoo/tiny-moe-fine` and its own MTP module.

    python -m engine.zoo.fine                                   # ~11 min on one thread -> zoo/tiny-moe-fine
    python -m engine.zoo.fine +experiment=zoo_fine_smoke        # < 1 min, tiny sizes, into a temp folder

A second routing regime next to `tiny-moe` (qwen2_moe, 16 experts top-2 + a large shared expert): a
`deepseek_v3` target (engine.zoo.configs.FineTargetConf: MLA, 64 experts top-6 + 1 shared expert, sigmoid
router with correction bias and group-limited choice, first layer dense) trained on the same corpus split with
tiny-moe's tokenizer (same token ids: traces of both compare prompt for prompt) and tiny-moe's token budget
(steps x batch x sequence), then its MTP module (DeepSeek-V3 layout) trained on the frozen shipped target and
written into the same folder, so `engine.Engine(target, drafter="mtp")` loads it (engine.zoo.train_fine).

Stages (`run`): (1) corpus split (engine.zoo.corpus, the zoo's caps) and the reused tokenizer; (2) the target
(`train_fine_target`); (3) its bf16 folder, re-loaded; (4) the frozen target's features over training windows
and the MTP module (`train_checkpoint_mtp`); (5) the folder again, now with the module; (6) the report on what
ships (engine.zoo.fine_report), side by side with `compare_with` (tiny-moe) measured in the same run; (7) the
`tiny-moe-fine` entry of `<out_dir>/manifest.json` and its section of `<out_dir>/README.md` (both kept by
`python -m engine.zoo`). Same seed, config, machine and thread count: same weights.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from tqdm import tqdm

from engine.cli import quiet_hydra_argv, step_bars
from engine.models.checkpoint import build_model, load_model, save_model
from engine.paths import repo_relative
from engine.zoo import corpus as corpus_lib
from engine.zoo import fine_report
from engine.zoo.build import merge_zoo_entry, tokenizer_config
from engine.zoo.configs import FineZooConf, fine_target_hf_config
from engine.zoo.head_objectives import target_pass
from engine.zoo.train_fine import new_checkpoint_mtp, save_with_mtp, train_checkpoint_mtp, train_fine_target
from engine.zoo.train_lm import OnStep, use_bf16_autocast


@dataclass
class FineResult:
    """What a run produced (the `tiny-moe-fine` entry of manifest.json)."""

    name: str
    seed: int
    autocast_bf16: bool
    shared_data_used: bool
    tokenizer: str
    target: dict  # training stats, params, active params per token, hf_config
    mtp: dict  # training stats, params, held-out t+2 metrics
    report: dict  # engine.zoo.fine_report.report: held-out, T(n)/T(1), distinct experts, acceptance, realism
    checkpoint_bytes: int
    seconds: dict
    config: dict
    machine: dict = field(default_factory=dict)


def run(
    conf: FineZooConf,
    out_dir: Path,
    shared_data: Path | None,
    log: Callable[[str], None] = lambda s: None,
    on_step: OnStep | None = None,
) -> FineResult:
    """Train and report `conf.target.name` into `out_dir` (see the module docstring)."""
    wall0 = time.perf_counter()
    seconds: dict[str, float] = {}
    torch.set_num_threads(conf.threads)
    torch.manual_seed(conf.seed)
    bf16 = use_bf16_autocast(conf.autocast)
    have_shared = shared_data is not None and (shared_data / "corpus").is_dir()
    tok_file = repo_relative(conf.tokenizer)
    if tok_file is None or not tok_file.is_file():
        raise FileNotFoundError(f"tokenizer {conf.tokenizer!r} not found (build tiny-moe first: python -m engine.zoo)")

    t0 = time.perf_counter()
    c = conf.corpus
    split = corpus_lib.assemble_corpus(shared_data if have_shared else None, c.heldout_fraction, c.chunk_chars,
                                       dict(c.train_chars), dict(c.heldout_chars))  # fmt: skip
    tok = Tokenizer.from_file(str(tok_file))
    train_streams = {k: corpus_lib.encode_stream(tok, split.train.get(k, [])) for k in split.corpora}
    heldout_streams = {k: corpus_lib.encode_stream(tok, split.heldout.get(k, [])) for k in split.corpora}
    T1 = conf.seq_len + 1
    train_windows = torch.cat([corpus_lib.windows(s, T1) for s in train_streams.values()])  # [W, T+1]
    per_corpus = max(1, conf.eval_tokens // conf.seq_len)
    heldout = {k: corpus_lib.windows(s, T1, per_corpus) for k, s in heldout_streams.items()}
    heldout = {k: w for k, w in heldout.items() if w.shape[0]}
    seconds["corpus"] = time.perf_counter() - t0
    log(f"corpus: {split.sizes()}; train windows {tuple(train_windows.shape)}")

    name = conf.target.name
    target = build_model(fine_target_hf_config(conf.target, tok.get_vocab_size()), seed=conf.seed)
    t0 = time.perf_counter()
    target_stats = train_fine_target(target, train_windows, conf.target, conf.seed, bf16, on_step)
    seconds["target"] = time.perf_counter() - t0
    log(f"target: {seconds['target']:.0f} s, {target_stats}")

    extra = {"tokenizer_config.json": json.dumps(tokenizer_config(max(conf.target.max_position_embeddings,
                                                                      conf.seq_len)), indent=2)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:  # the MTP module learns on the shipped (bf16) target
        shipped = load_model(save_model(target, Path(tmp) / name, torch.bfloat16))
    shipped.path = None
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(conf.seed)
    mtp_windows = train_windows
    if mtp_windows.shape[0] > conf.mtp.train_windows:
        mtp_windows = mtp_windows[torch.randperm(mtp_windows.shape[0], generator=gen)[: conf.mtp.train_windows]]
    data = target_pass(shipped, mtp_windows)
    mtp = new_checkpoint_mtp(shipped, conf.seed + 1)
    mtp_stats = train_checkpoint_mtp(mtp, shipped, mtp_windows, data, conf.mtp, conf.target.seq_aux_loss_coef,
                                     conf.target.bias_update_speed, conf.seed + 1, bf16, on_step)  # fmt: skip
    seconds["mtp"] = time.perf_counter() - t0
    log(f"mtp: {seconds['mtp']:.0f} s, {mtp_stats}")
    folder = save_with_mtp(shipped, mtp, out_dir / name, torch.bfloat16, tok_file, extra)

    t0 = time.perf_counter()  # everything below measures what ships
    shipped = load_model(folder)
    compare = load_model(repo_relative(conf.compare_with)) if conf.compare_with else None
    report = fine_report.report(shipped, compare, heldout, conf.eval, list(conf.curve_tokens), log)
    seconds["eval"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - wall0
    result = FineResult(
        name=name,
        seed=conf.seed,
        autocast_bf16=bf16,
        shared_data_used=have_shared,
        tokenizer=str(conf.tokenizer),
        target={**target_stats, **fine_report.param_counts(shipped), "hf_config": shipped.config.raw},
        mtp={
            **mtp_stats,
            "params": sum(p.numel() for p in mtp.parameters() if p.requires_grad),
            "train_windows": list(mtp_windows.shape),
        },  # fmt: skip
        report=report,
        checkpoint_bytes=sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
        seconds=seconds,
        config=asdict(conf),
        machine={"python": platform.python_version(), "torch": torch.__version__, "threads": conf.threads},
    )
    merge_zoo_entry(out_dir, name, asdict(result), fine_report.render_section(result))
    return result


@hydra.main(config_path="../../conf", config_name="zoo_fine", version_base=None)
def main(cfg) -> None:
    conf: FineZooConf = OmegaConf.to_object(cfg)
    out_dir = Path(to_absolute_path(conf.out_dir))
    shared = repo_relative(conf.corpus.shared_data)
    result = run(conf, out_dir, shared, log=tqdm.write, on_step=step_bars() if conf.progress else None)
    print(f"\n{result.name} -> {out_dir / result.name} ({result.checkpoint_bytes / 1e6:.1f} MB)\n")
    print(fine_report.render_section(result))
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result.seconds.items())
    print(f"wall time: {result.seconds['total'] / 60:.1f} min ({phases})")


if __name__ == "__main__":
    quiet_hydra_argv()  # no outputs/ folder in the working directory, like the other entry points
    main()
