"""Train the feature-head drafters and the expert predictor on top of a frozen MoE target.

    python -m engine.zoo.train_heads                    # zoo/tiny-moe -> zoo/{eagle-head,mtp-head,expert-predictor}
    python -m engine.zoo.train_heads smoke=true         # < 40 s: random tiny target, bytes as tokens, temp dir
    python -m engine.zoo.train_heads target=/path/to/moe out_dir=/tmp/heads seed=1 eagle.train.steps=200

Stages (`train_all_heads`, the function engine.zoo calls; the objectives live in `engine/zoo/head_objectives.py`):
1. windows [W, T+1] from the token streams (engine.zoo's corpus split, tokenised with the target's
   tokenizer.json: held-out = the zoo's held-out documents);
2. one frozen target pass (`Model.forward_batch(record_routing=True)`): features f [W, T, D] (final hidden
   states after the norm) and routing expert_ids [W, T, L, r];
3. EAGLE head (2401.15077 §4.3): reg_weight * smooth-L1(f^_{t+1}, f_{t+1}) + cls_weight * CE(target law
   of x_{t+2}, lm_head(f^_{t+1})), inputs (f_t + U(-a, a) noise, emb(x_{t+1}));
4. MTP module (DeepSeek-V3 2412.19437 §2.2): CE(x_{t+2}) from (f_t, emb(x_{t+1})), plus target_kl_weight *
   CE against the target's law of x_{t+2} (distillation; 0 = the paper's loss);
5. expert predictor on the EAGLE head's teacher-forced outputs f^_t -> routing of position t;
6. bf16 folders (config.json, model.safetensors, metrics.json), re-loaded for every evaluation: held-out
   EAGLE top-1 agreement with the target, MTP top-1 accuracy for t+2, predictor top-r recall per layer
   against r/E and a popularity baseline, τ and expert footprint through `engine.Engine`.
Same seed, config, machine and thread count: same weights. One thread by default: with other jobs on the
2 cores, two intra-op threads ran 3-8x slower than one.

Shape letters: W=windows B=batch T=window length D=hidden V=vocab L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf
from tqdm import tqdm

from engine.cli import quiet_hydra_argv, step_bars
from engine.drafting.feature_drafter import EagleDrafter, MTPDrafter, MTPHead
from engine.models.checkpoint import load_model
from engine.models.expert_predictor import (
    load_expert_predictor,
    save_expert_predictor,
)
from engine.models.feature_heads import EagleHead, HeadConfig, load_eagle_head, load_mtp_head, save_head, target_digest
from engine.models.transformer import Model
from engine.paths import repo_relative, zoo_path
from engine.zoo import corpus as corpus_lib
from engine.zoo.configs import (
    HEAD_NAMES,
    DataConf,
    TrainHeadsConf,
    smoke_conf,
)
from engine.zoo.head_objectives import (
    evaluate_heads,
    head_outputs,
    new_expert_predictor,
    num_params,
    predictor_report,
    smoke_target,
    speculative_eval,
    target_pass,
    train_eagle,
    train_mtp,
    train_predictor,
)
from engine.zoo.train_lm import OnStep


# ---------------------------------------------------------------------------------------------- the run
def _windows(streams: dict[str, torch.Tensor], T1: int, max_windows: int | None = None) -> torch.Tensor:
    parts = [corpus_lib.windows(s, T1, max_windows) for s in streams.values()]
    parts = [p for p in parts if p.shape[0]]
    return torch.cat(parts) if parts else torch.empty(0, T1, dtype=torch.long)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def train_all_heads(
    target: Model | str | Path,
    out_dir: str | Path,
    train_streams: dict[str, torch.Tensor],
    heldout_streams: dict[str, torch.Tensor],
    conf: TrainHeadsConf,
    on_step: OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Train EAGLE head, MTP module and expert predictor on `target`; write the three folders; return metrics.

    train_streams / heldout_streams: corpus name -> token stream [N] (engine.corpus.encode_stream)."""
    wall0 = time.perf_counter()
    seconds: dict[str, float] = {}
    if not isinstance(target, Model):
        target = load_model(target)
    target.eval().requires_grad_(False)
    out_dir = Path(out_dir)
    d = conf.data
    T1 = d.seq_len + 1
    gen = torch.Generator().manual_seed(conf.seed)
    train_windows = _windows(train_streams, T1)
    if train_windows.shape[0] > d.train_windows:
        train_windows = train_windows[torch.randperm(train_windows.shape[0], generator=gen)[: d.train_windows]]
    heldout_windows = _windows(heldout_streams, T1, max(1, d.eval_tokens // d.seq_len))
    if heldout_windows.shape[0] == 0:
        raise ValueError(f"no held-out window of {T1} tokens")
    log(f"windows: train {tuple(train_windows.shape)}, held-out {tuple(heldout_windows.shape)}")

    t0 = time.perf_counter()
    train_data = target_pass(target, train_windows)
    heldout_data = target_pass(target, heldout_windows)
    seconds["target_pass"] = time.perf_counter() - t0
    log(f"target pass: {seconds['target_pass']:.0f} s")

    torch.manual_seed(conf.seed)
    eagle = EagleHead(HeadConfig.for_target(target.config, conf.eagle.intermediate_size))
    mtp = MTPHead(HeadConfig.for_target(target.config, conf.mtp.intermediate_size))
    t0 = time.perf_counter()
    eagle_stats = train_eagle(eagle, target, train_windows, train_data, conf.eagle, conf.seed, on_step)
    seconds["eagle"] = time.perf_counter() - t0
    log(f"eagle head: {seconds['eagle']:.0f} s, {eagle_stats}")
    t0 = time.perf_counter()
    mtp_stats = train_mtp(mtp, target, train_windows, train_data, conf.mtp, conf.seed + 1, on_step)
    seconds["mtp"] = time.perf_counter() - t0
    log(f"mtp module: {seconds['mtp']:.0f} s, {mtp_stats}")
    # everything below uses what ships: the bf16 folders re-loaded into the target's dtype
    paths = {name: out_dir / name for name in HEAD_NAMES}
    save_head(eagle, paths["eagle-head"], target, extra={"objective": "eagle 2401.15077"})
    save_head(mtp, paths["mtp-head"], target, extra={"objective": "mtp 2412.19437"})
    eagle, mtp = load_eagle_head(paths["eagle-head"], target), load_mtp_head(paths["mtp-head"], target)

    # predictor: the EAGLE head's output at position t (what the drafter holds for a node) -> routing at t
    t0 = time.perf_counter()
    sides = ((train_windows, train_data), (heldout_windows, heldout_data))
    feats = [head_outputs(eagle, target, w, data).flatten(0, 1) for w, data in sides]  # [W*(T-1), D]
    ids = [data.expert_ids[:, 1:].flatten(0, 1) for _, data in sides]  # [W*(T-1), L, r]
    predictor = new_expert_predictor(target, feats[0].shape[-1], "eagle", conf.predictor)
    predictor_stats = train_predictor(predictor, feats[0], ids[0], conf.predictor, conf.seed + 2, on_step)
    head_info = {"input_head": "eagle-head", "target_weights_sha256": target_digest(target)}
    save_expert_predictor(predictor, paths["expert-predictor"], extra=head_info)
    predictor = load_expert_predictor(paths["expert-predictor"], target.device, target.dtype)
    predictor_metrics = {**predictor_stats, **predictor_report(predictor, feats[1], ids[1], ids[0])}
    seconds["predictor"] = time.perf_counter() - t0
    log(f"expert predictor: {seconds['predictor']:.0f} s, recall {predictor_metrics['topr_recall_per_layer']}")
    dense_metrics = None
    if conf.predictor.dense_drafter:  # a dense drafter's hidden state at position t -> routing at t
        t0 = time.perf_counter()
        drafter = load_model(repo_relative(conf.predictor.dense_drafter))
        feats = [target_pass(drafter, w).features.flatten(0, 1) for w, _ in sides]  # [W*T, D']
        ids = [data.expert_ids.flatten(0, 1) for _, data in sides]  # [W*T, L, r]
        dense = new_expert_predictor(target, feats[0].shape[-1], "dense", conf.predictor)
        dense_stats = train_predictor(dense, feats[0], ids[0], conf.predictor, conf.seed + 3, on_step)
        paths["expert-predictor-dense"] = out_dir / "expert-predictor-dense"
        save_expert_predictor(dense, paths["expert-predictor-dense"],
                              extra={"input_drafter": str(conf.predictor.dense_drafter)})  # fmt: skip
        dense = load_expert_predictor(paths["expert-predictor-dense"], target.device, target.dtype)
        dense_metrics = {**dense_stats, **predictor_report(dense, feats[1], ids[1], ids[0])}
        seconds["predictor_dense"] = time.perf_counter() - t0
        log(f"dense-drafter expert predictor: recall {dense_metrics['topr_recall_per_layer']}")

    t0 = time.perf_counter()
    head_metrics = evaluate_heads(eagle, mtp, target, heldout_windows, heldout_data)
    c = conf.eval
    prompts = [w[: c.prompt_len].tolist() for w in heldout_windows[:: max(1, heldout_windows.shape[0] // c.prompts)]]
    drafters = {"eagle": EagleDrafter(eagle, target, predictor), "mtp": MTPDrafter(mtp, target)}
    spec_metrics = speculative_eval(target, drafters, prompts[: c.prompts], c)
    seconds["eval"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - wall0
    metrics = {
        "eagle": {**eagle_stats, **{k: v for k, v in head_metrics.items() if not k.startswith("mtp")},
                  "params": num_params(eagle), "speculative": spec_metrics["eagle"]},
        "mtp": {**mtp_stats, **{k: v for k, v in head_metrics.items() if k.startswith("mtp") or k == "positions"},
                "params": num_params(mtp), "speculative": spec_metrics["mtp"]},
        "expert_predictor": predictor_metrics,
        "data": {"train_windows": list(train_windows.shape), "heldout_windows": list(heldout_windows.shape)},
        "seconds": seconds,
        "seed": conf.seed,
    }  # fmt: skip
    keys = {"eagle-head": "eagle", "mtp-head": "mtp", "expert-predictor": "expert_predictor"}
    if dense_metrics is not None:
        metrics["expert_predictor_dense"] = dense_metrics
        keys["expert-predictor-dense"] = "expert_predictor_dense"
    for name, key in keys.items():
        (paths[name] / "metrics.json").write_text(json.dumps(metrics[key], indent=2, sort_keys=True) + "\n")
    metrics["bytes"] = {name: _folder_bytes(p) for name, p in paths.items()}
    return metrics


def corpus_streams(target: Model, d: DataConf) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The zoo corpus split tokenised with the target's tokenizer -> (train, held-out) streams per corpus."""
    if target.tokenizer is None:
        raise ValueError(f"the target at {target.path} has no tokenizer.json")
    shared = repo_relative(d.shared_data)
    shared = shared if shared is not None and (shared / "corpus").is_dir() else None
    split = corpus_lib.assemble_corpus(shared, d.heldout_fraction, d.chunk_chars, dict(d.train_chars),
                                      dict(d.heldout_chars))  # fmt: skip
    train = {c: corpus_lib.encode_stream(target.tokenizer, split.train.get(c, [])) for c in split.corpora}
    heldout = {c: corpus_lib.encode_stream(target.tokenizer, split.heldout.get(c, [])) for c in split.corpora}
    return train, heldout


def byte_streams(d: DataConf) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Smoke data: the English help topics as UTF-8 bytes (vocab 256), split by document name."""
    split = corpus_lib.split_corpus(corpus_lib.english_documents(d.chunk_chars), d.heldout_fraction)
    as_bytes = lambda docs: torch.tensor(list("".join(x.text for x in docs).encode()), dtype=torch.long)  # noqa: E731
    return {"english": as_bytes(split.train["english"])}, {"english": as_bytes(split.heldout["english"])}


def run(conf: TrainHeadsConf, on_step: OnStep | None = None, log: Callable[[str], None] = lambda s: None) -> dict:
    """Resolve target, data and out_dir from `conf` (smoke or real) and train all heads."""
    torch.set_num_threads(conf.threads)
    if conf.smoke:
        conf = smoke_conf(conf)
        target = smoke_target(conf.seed)
        train, heldout = byte_streams(conf.data)
        out_dir = Path(tempfile.mkdtemp(prefix="expertspec-heads-smoke-"))
    else:
        target = load_model(repo_relative(conf.target) if conf.target else zoo_path("tiny-moe"))
        train, heldout = corpus_streams(target, conf.data)
        out_dir = Path(to_absolute_path(conf.out_dir))
    log(f"target {target.path or 'random smoke target'}; out_dir {out_dir}")
    metrics = train_all_heads(target, out_dir, train, heldout, conf, on_step, log)
    metrics["out_dir"] = str(out_dir)
    return metrics


@hydra.main(config_path="../../conf", config_name="train_heads", version_base=None)
def main(cfg) -> None:
    conf: TrainHeadsConf = OmegaConf.to_object(cfg)
    m = run(conf, on_step=step_bars() if conf.progress else None, log=tqdm.write)
    e, t, p = m["eagle"], m["mtp"], m["expert_predictor"]
    print(f"\nheads -> {m['out_dir']}  (held-out positions: {e['positions']})")
    print(
        f"EAGLE head: top-1 agreement with the target {e['eagle_top1_agreement']:.3f} "
        f"(text accuracy {e['eagle_top1_accuracy']:.3f}; target's own {e['target_top1_accuracy']:.3f})"
    )
    print(
        f"MTP module: top-1 accuracy for t+2 {t['mtp_top1_accuracy_t2']:.3f}, "
        f"agreement with the target's t+2 argmax {t['mtp_top1_agreement_t2']:.3f}"
    )
    print(
        f"expert predictor top-r recall per layer: "
        f"{p['topr_recall_per_layer']} (mean {p['topr_recall_mean']:.3f}; random {p['random_baseline']:.3f}; "
        f"popularity {p['popularity_baseline_per_layer']})"
    )
    if "expert_predictor_dense" in m:
        q = m["expert_predictor_dense"]
        print(f"dense-drafter expert predictor top-r recall per layer: {q['topr_recall_per_layer']}")
    for name in ("eagle", "mtp"):
        for spec, s in m[name]["speculative"].items():
            print(
                f"  {name:<5} {spec:<26} tau {s['tau']:.2f}  verified/round {s['verified_per_round']:.1f}  "
                f"experts/layer {s['distinct_experts_per_layer']:.2f}  exact {s['exact']}"
            )
    print(f"bytes: {m['bytes']}")
    print(f"seconds: {', '.join(f'{k} {v:.0f}' for k, v in m['seconds'].items())}")
    if not math.isfinite(e["final_reg"]):
        raise SystemExit("EAGLE training diverged")


if __name__ == "__main__":
    quiet_hydra_argv()  # no outputs/ folder in the working directory, like the other entry points
    main()
