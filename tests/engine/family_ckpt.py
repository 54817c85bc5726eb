"""Tiny random transformers checkpoints of the DeepSeek-V3-era families, with routing that matters:
weights ~ N(0, 0.2), router rows scaled up (sharp, token-dependent choices) and random correction biases
(so the bias really changes which experts are picked). Shared by test_deepseek_v3 / test_glm4_moe / ..."""

from __future__ import annotations

import os
import subprocess
import sys
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
