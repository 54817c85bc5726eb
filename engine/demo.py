"""The expertspec demo (`python -m engine.demo`, the README's first command).

Loads the shipped tiny MoE target and its drafters, decodes code and prose prompts target-only and
with exact speculation (dense drafter, n-gram lookup), checks the speculative text is identical, and
prints committed tokens per round (τ), acceptance by depth, mean distinct experts per layer per
verification, and the speed-up measured side by side. Any field of `DemoConfig` can be overridden:

    python -m engine.demo new_tokens=64 depth=6 width=2 prompt="def fibonacci(n):"
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf


@dataclass
class DemoConfig:
    target: str | None = None  # checkpoint folder; None = zoo/tiny-moe
    drafter: str | None = None  # None = zoo/tiny-dense
    prompt: str | None = None  # one custom prompt instead of the built-in code + prose ones
    new_tokens: int = 96
    depth: int = 4
    width: int = 1
    temperature: float = 0.0
    seed: int = 0
    threads: int = 1
    show_text: bool = True


ConfigStore.instance().store(name="demo_schema", node=DemoConfig)


def _summary(res) -> dict:
    rounds = [r for x in res for r in x.rounds]
    K = max((r.depth for r in rounds), default=0)
    acc = []
    for d in range(K):
        att = sum(r.attempted_by_depth[d] for r in rounds if len(r.attempted_by_depth) > d)
        ok = sum(r.accepted_by_depth[d] for r in rounds if len(r.accepted_by_depth) > d)
        acc.append(ok / att if att else float("nan"))
    return {
        "tau": sum(r.committed for r in rounds) / max(len(rounds), 1),
        "acc": acc,
        "experts": statistics.mean(r.mean_distinct_experts for r in rounds),
        "n": statistics.mean(r.verified_tokens for r in rounds),
    }


@hydra.main(config_path=None, config_name="demo_schema", version_base=None)
def main(cfg: DemoConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    torch.set_num_threads(cfg.threads)
    import engine
    from engine.workloads import Prompt, code_prompts, encode, prose_prompts
    from engine.zoo.build import zoo_path

    target = engine.load_model(cfg.target or zoo_path("tiny-moe"))
    drafter = engine.load_model(cfg.drafter or zoo_path("tiny-dense"))
    tok = target.tokenizer
    if tok is None:
        raise SystemExit("the target folder has no tokenizer.json; the demo needs one to encode prompts")
    prompts = [Prompt(cfg.prompt, "custom")] if cfg.prompt else code_prompts(2) + prose_prompts(2)
    ids = encode(tok, prompts, 192)
    sampling = engine.SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
    spec = engine.SpecConfig(depth=cfg.depth, width=cfg.width)
    c = target.config
    print(
        f"target: {c.model_type}, {c.num_layers} layers, {c.num_experts} experts top-{c.top_r}, "
        f"{sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params; drafter: "
        f"{drafter.config.model_type}, {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params"
    )
    runs = {
        "target-only": engine.Engine(target),
        f"dense drafter K={cfg.depth} W={cfg.width}": engine.Engine(target, drafter=drafter),
        f"n-gram lookup K={cfg.depth}": engine.Engine(target, drafter="ngram"),
    }
    results, walls = {}, {}
    for name, eng in runs.items():
        eng.generate(ids[:1], 4, sampling=sampling, spec=None if name == "target-only" else spec)  # warm-up
        t0 = time.perf_counter()
        results[name] = eng.generate(
            ids, cfg.new_tokens, sampling=sampling, spec=None if name == "target-only" else spec
        )
        walls[name] = time.perf_counter() - t0
    base = results["target-only"]
    if cfg.show_text:
        for p, r in zip(prompts, base):
            print(f"\n--- {p.category} prompt ---\n{p.text[-300:]}\n--- continuation ({len(r.token_ids)} tokens) ---")
            print(tok.decode(r.token_ids))
    print(
        f"\n{'decoding':<28} {'tok/s':>7} {'speed-up':>8} {'tau':>5} {'n':>5} {'experts/layer':>13}  "
        f"acceptance by depth   identical"
    )
    for name, res in results.items():
        s = _summary(res)
        toks = sum(len(r.token_ids) for r in res)
        same = [r.token_ids for r in res] == [r.token_ids for r in base]
        acc = " ".join("-" if a != a else f"{a:.2f}" for a in s["acc"]) or "-"  # NaN: depth never reached
        print(
            f"{name:<28} {toks / walls[name]:>7.0f} {walls['target-only'] / walls[name]:>7.2f}x "
            f"{s['tau']:>5.2f} {s['n']:>5.1f} {s['experts']:>13.2f}  {acc:<21} {same}"
        )
    print(
        "\n(speed-ups are wall clock on this machine, measured in this run; greedy speculation is exact, so the "
        "text is identical)"
        if cfg.temperature == 0
        else ""
    )


if __name__ == "__main__":
    from engine.cli import quiet_hydra_argv

    quiet_hydra_argv()
    main()
