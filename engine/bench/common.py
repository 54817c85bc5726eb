"""What the benchmark modes share: checkpoint paths, prompt sets, transformers generate as the baseline."""

from __future__ import annotations

import torch

from engine.bench.configs import BenchConfig


def bench_paths(cfg: BenchConfig) -> tuple[str, str]:
    if cfg.target and cfg.drafter:
        return cfg.target, cfg.drafter
    from engine.zoo.build import zoo_path

    return cfg.target or str(zoo_path("tiny-moe")), cfg.drafter or str(zoo_path("tiny-dense"))


def bench_prompts(cfg: BenchConfig, model, n: int) -> list[list[int]]:
    """n prompts of `cfg.workload` encoded with the model's tokenizer (ValueError when it has none)."""
    from engine.workloads import encode, workload

    if model.tokenizer is None:
        raise ValueError(
            f"{model.path or 'the target'} has no tokenizer.json: the benchmarks encode their text prompts with the "
            "target's tokenizer; pass target=<a checkpoint folder with tokenizer.json> (the zoo's have one)"
        )
    ps = workload(cfg.workload, n, cfg.prompts)
    if not ps:
        raise ValueError("the workload produced no prompts")
    while len(ps) < n:
        ps = ps + ps
    return encode(model.tokenizer, ps[:n], cfg.prompt_len)


def equal_length(prompts: list[list[int]]) -> list[list[int]]:
    """Trim to a common length so transformers needs no padding (same prompts for both engines)."""
    m = min(len(p) for p in prompts)
    return [p[-m:] for p in prompts]


def hf_generate(hf, prompts: list[list[int]], n: int, assistant=None) -> list[list[int]]:
    """transformers greedy `generate` of exactly n new tokens (assisted generation when `assistant` is given);
    an explicit all-ones attention mask, or transformers masks every prompt token equal to the pad id."""
    ids = torch.tensor(prompts, device=hf.device)
    kwargs = {} if assistant is None else {"assistant_model": assistant}
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[:, ids.shape[1] :].cpu().tolist()


def learned_policy(path: str | None, cost: str = "measured-cpu", setting: str = "serve_bench.learned_path") -> str:
    """The frozen policy to deploy: `path`, else the newest cached main-job AggreVaTe (seed 0) trained under the
    cost model named `cost` (the cache `python -m ctrl` fills under engine.paths.cache_dir()/policies)."""
    if path:
        return path
    from engine.paths import cache_dir

    found = sorted((cache_dir() / "policies").glob(f"*/{cost}/aggrevate/seed0"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no learned policy trained under {cost!r} cached: run the main job "
                                f"(`python -m ctrl`) or set {setting}=PATH")  # fmt: skip
    return str(found[-1])
