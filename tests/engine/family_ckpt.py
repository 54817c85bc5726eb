"""Tiny random transformers checkpoints of the DeepSeek-V3-era families, with routing that matters:
weights ~ N(0, 0.2), router rows scaled up (sharp, token-dependent choices) and random correction biases
(so the bias really changes which experts are picked). Shared by test_deepseek_v3 / test_glm4_moe / ..."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import transformers

import engine

PROMPTS = [[5, 7, 9, 11, 3], [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [60]]


def random_hf_model(model_type: str, seed: int = 0, router_scale: float = 4.0, **config):
    """A transformers model of `model_type` with the randomisation of the module docstring (float32, eval)."""
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(router_scale)
            if name.endswith("self_attn.sinks"):  # large sinks: heads really lose mass to them
                p.mul_(10.0)
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return ref


def save_pair(model_type: str, path: Path, seed: int = 0, **config):
    """(transformers reference, our model loaded from the folder the reference saved)."""
    ref = random_hf_model(model_type, seed, **config)
    ref.save_pretrained(path)
    return ref, engine.load_model(path)


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def cached_logits(model, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] of `tokens` run through the paged cache in causal chunks of these sizes."""
    from engine.models.batching import chain_item, pack
    from engine.models.kv_cache import PagedKVCache

    kv = PagedKVCache.for_model(model.config, -(-len(tokens) // 4) + 1, 4, model.dtype, model.device)
    kv.add_sequence(0)
    kv.reserve(0, len(tokens))
    slots = kv.slots(0, range(len(tokens)))
    out, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            item = chain_item(tokens[done : done + n], slots[:done], slots[done : done + n])
            out.append(model.forward_batch(pack([item], model.device), kv).logits)
            done += n
    return torch.cat(out)


REPO = Path(__file__).resolve().parents[2]


def script_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)


def run_two_ranks(script: str, tmp_path: Path) -> None:
    """`python -c script RANK STORE` as 2 gloo ranks over a FileStore; both must print OK."""
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(r), str(tmp_path / "store")], cwd=REPO, env=script_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:  # only the ranks started here
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "OK" in out, out[-3000:]


def run_triton_interpreter(script: str) -> None:
    """`python -c script` with TRITON_INTERPRET=1 (a fresh process: triton reads it at import); must print OK."""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=script_env(TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


TRITON_CHECK = textwrap.dedent(
    """
    ref = engine.Engine(target, backend="torch").generate(prompts, 6)
    tri = engine.Engine(target, backend="triton").generate(prompts, 6)
    assert [r.token_ids for r in ref] == [r.token_ids for r in tri], "triton backend changed the tokens"
    print("OK")
    """
)


def ep_check(after_shard: str = "") -> str:
    """The body of a two-rank EP script after a MODEL snippet (defines `target` and `prompts`): target-only and
    n-gram tree speculation under EP equal the single-process tokens; `after_shard` runs once sharded."""
    return (
        textwrap.dedent(
            """
        from datetime import timedelta
        import torch.distributed as dist
        from engine.parallel.ep import EPGroup, shard_model
        from engine.parallel.placement import place_experts
        rank, store = int(sys.argv[1]), sys.argv[2]
        torch.set_num_threads(1)
        ref = [r.token_ids for r in engine.Engine(target).generate(prompts, 12)]
        dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        placement = place_experts(target.config.num_experts, 2, "round_robin", ranks_per_node=1)
        ep = shard_model(target, EPGroup(rank, 2, placement, 1))
        """
        )
        + textwrap.dedent(after_shard)
        + textwrap.dedent(
            """
        mine = prompts[rank::2]  # different requests per rank: the lockstep idle steps are exercised too
        out = engine.Engine(target, ep=ep).generate(mine, 12)
        assert [r.token_ids for r in out] == ref[rank::2], "EP changed the tokens"
        out = engine.Engine(target, drafter="ngram", ep=ep).generate(mine, 12, spec=engine.SpecConfig(depth=3, width=2))
        assert [r.token_ids for r in out] == ref[rank::2], "EP speculation changed the tokens"
        dist.destroy_process_group()
        print("OK")
        """
        )
    )


def check_offload_virtual_ep_and_cost(target) -> None:
    """Expert offload (2 cached experts per layer) keeps the greedy tokens; virtual EP and the roofline cost model
    (spec from the HF config) run on the family's routing under n-gram tree speculation, tokens unchanged."""
    from engine.cost.roofline import RooflineCost, load_hardware, model_spec_from_hf_config
    from engine.offload.cache import ExpertOffload
    from engine.parallel.placement import place_experts

    ref = [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 16)]
    with ExpertOffload(target, 2) as off:
        assert [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 16)] == ref
        assert off.stats.misses > 0
    cfg = target.config
    placement = place_experts(cfg.num_experts, 2, "contiguous", ranks_per_node=1)
    cost = RooflineCost(load_hardware("h200"), model_spec_from_hf_config(cfg.raw))
    eng = engine.Engine(target, drafter="ngram", virtual_ep=placement, cost_model=cost)
    res = eng.generate(PROMPTS, 16, spec=engine.SpecConfig(depth=3, width=2))
    assert [r.token_ids for r in res] == ref
    rounds = [s for r in res for s in r.rounds]
    assert all(len(s.distinct_experts) == len(cfg.moe_layers) and s.modelled_seconds > 0 for s in rounds)
    assert all(s.rank_imbalance_max >= 1.0 for s in rounds)
    assert sum(s.verified_tokens for s in rounds) > len(rounds)
