"""`python -m engine.zoo.realism_report`: how real targets look on their own greedy paths, side by side.

    python -m engine.zoo.realism_report targets=[tiny-moe,tiny-moe-long]
    python -m engine.zoo.realism_report targets=[tiny-moe,tiny-moe-long] zoo_entry=tiny-moe-long note="..."

For every target (a zoo name or a checkpoint folder; all must share one tokenizer) and built-in workload:
the three figures of `engine.zoo.realism` (mean top-token probability, entropy, share of generated 4-grams
repeating an earlier one) and, as speculation sees it, the greedy n-gram drafter's committed tokens per round
(chain K = `ngram_depth`, every output checked equal to target-only). `zoo_entry=NAME` merges the table into
zoo/manifest.json and zoo/README.md under NAME (`engine.zoo.build.merge_zoo_entry`); `out=PATH` writes JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from engine.cli import quiet_hydra_argv
from engine.models.checkpoint import load_model
from engine.paths import repo_relative, zoo_dir, zoo_path
from engine.runtime.engine import Engine
from engine.spec.config import SpecConfig
from engine.workloads import BUILTIN, encode, workload
from engine.zoo.realism import greedy_path_figures

EOS = 0  # <|endoftext|> of the zoo tokenizer


@dataclass
class RealismConf:
    targets: list[str] = field(default_factory=lambda: ["tiny-moe"])  # zoo names or checkpoint folders
    workloads: list[str] = field(default_factory=lambda: ["code", "prose", "chat", "math"])
    prompts: int = 8  # per workload
    new_tokens: int = 64
    max_prompt_tokens: int = 128
    ngram_depth: int = 4
    threads: int = 1
    zoo_entry: str | None = None  # merge the table into the zoo's manifest.json / README.md under this name
    note: str = ""  # markdown above the table in the zoo README (e.g. the training command)
    # a zoo run's manifest.json (python -m engine.zoo out_dir=...): its target, held-out and timing entries are kept
    # with the zoo entry, so the shipped folder's manifest says how it was trained
    training_manifest: str | None = None
    out: str | None = None


def _resolve(name: str) -> Path:
    p = Path(name)
    if (p / "config.json").is_file():
        return p
    return zoo_path(name)  # a clear error naming the known zoo names


def check(conf: RealismConf) -> list[Path]:
    """Clear errors before any model loads: unknown workload, missing checkpoint, bad budget."""
    unknown = [w for w in conf.workloads if w not in BUILTIN]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; built-in: {sorted(BUILTIN)}")
    if not conf.targets:
        raise ValueError("targets must name at least one checkpoint")
    if conf.prompts < 1 or conf.new_tokens < 1 or conf.ngram_depth < 1:
        raise ValueError("prompts, new_tokens and ngram_depth must be >= 1")
    return [_resolve(t) for t in conf.targets]


@torch.inference_mode()
def ngram_tau(target, prompts: list[list[int]], new_tokens: int, depth: int) -> float:
    """Committed tokens per round of the greedy n-gram chain (outputs checked equal to target-only)."""
    base = Engine(target, timing=False).generate(prompts, new_tokens, eos_token_id=EOS)
    spec = Engine(target, drafter="ngram", timing=False).generate(
        prompts, new_tokens, spec=SpecConfig(depth=depth), eos_token_id=EOS
    )
    if [r.token_ids for r in spec] != [r.token_ids for r in base]:
        raise AssertionError("n-gram speculation changed the greedy output")  # exactness is the engine's contract
    rounds = [r for res in spec for r in res.rounds]
    return sum(r.committed for r in rounds) / max(len(rounds), 1)


def report(conf: RealismConf, log=lambda s: None) -> dict[str, Any]:
    paths = check(conf)
    if conf.training_manifest and not Path(repo_relative(conf.training_manifest)).is_file():
        raise FileNotFoundError(f"training_manifest={conf.training_manifest}: no such file")
    torch.set_num_threads(conf.threads)
    models = {p.name: load_model(p) for p in paths}
    first = next(iter(models.values()))
    out: dict[str, Any] = {"targets": {n: str(p) for n, p in zip(models, paths)}, "figures": {}, "ngram_tau": {}}
    for name in conf.workloads:
        prompts = encode(first.tokenizer, workload(name, conf.prompts), conf.max_prompt_tokens)
        for t, m in models.items():
            out["figures"].setdefault(t, {})[name] = asdict(greedy_path_figures(m, prompts, conf.new_tokens, EOS))
            out["ngram_tau"].setdefault(t, {})[name] = ngram_tau(m, prompts, conf.new_tokens, conf.ngram_depth)
        log(f"workload {name} done")
    out["settings"] = asdict(conf)
    return out


def markdown(rep: dict[str, Any]) -> str:
    s = rep["settings"]
    names = list(rep["targets"])
    lines = [f"On each target's own greedy path ({s['prompts']} prompts × {s['new_tokens']} tokens per built-in "
             f"workload, stopping at end-of-text; `engine.zoo.realism`): mean top-token probability / entropy (nats) / "
             f"share of generated 4-grams repeating an earlier one; τ = committed tokens per round of the greedy "
             f"n-gram chain K = {s['ngram_depth']} (outputs equal to target-only):", "",
             "| workload | " + " | ".join(f"{n}: top p / entropy / repeat4 / n-gram τ" for n in names) + " |",
             "|---|" + "---|" * len(names)]  # fmt: skip
    for w in s["workloads"]:
        cells = []
        for n in names:
            f = rep["figures"][n][w]
            cells.append(f"{f['top_prob']:.2f} / {f['entropy']:.2f} / {100 * f['repeat4']:.0f} % / "
                         f"{rep['ngram_tau'][n][w]:.2f}")  # fmt: skip
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


ConfigStore.instance().store(name="realism_schema", node=RealismConf)


@hydra.main(config_path=None, config_name="realism_schema", version_base=None)
def main(cfg) -> None:
    conf: RealismConf = OmegaConf.to_object(cfg)
    t0 = time.perf_counter()
    rep = report(conf, log=print)
    table = markdown(rep)
    print("\n" + table)
    if conf.out:
        Path(repo_relative(conf.out)).write_text(json.dumps(rep, indent=2))
    if conf.zoo_entry:
        from engine.zoo.build import merge_zoo_entry

        entry: dict[str, Any] = {"realism": rep, "seconds": time.perf_counter() - t0}
        if conf.training_manifest:
            run = json.loads(Path(repo_relative(conf.training_manifest)).read_text())
            entry["training"] = {k: run[k] for k in ("target", "heldout", "seconds", "seed", "shared_data_used",
                                                     "config", "machine", "verify_cost_curve") if k in run}  # fmt: skip
        merge_zoo_entry(zoo_dir(), conf.zoo_entry, entry, (conf.note.strip() + "\n\n" if conf.note else "") + table)
        print(f"\nmerged into {zoo_dir() / 'README.md'} and manifest.json as {conf.zoo_entry!r}")


if __name__ == "__main__":
    quiet_hydra_argv()
    main()
