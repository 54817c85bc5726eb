"""drafter="mtp": the MTP module shipped inside a DeepSeek-V3 / GLM-4.5 checkpoint (layer num_hidden_layers with
enorm, hnorm, eh_proj, shared_head), loaded from the target's own folder.

Checkpoints are built in the published layout with random weights; the module's forward is checked against a
reference written here from the format's definition (over transformers' own decoder layer)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from family_ckpt import PROMPTS, random_hf_model
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import DS, YARN
from test_glm4_moe import GLM

import engine
from engine.drafting.mtp_drafter import load_mtp_drafter
from engine.models.batching import chain_item, pack
from engine.models.checkpoint import CheckpointError, build_model
from engine.models.mtp import load_checkpoint_mtp
from engine.spec.sampling import SamplingParams

L = 3  # decoder layers; the MTP module is layer 3
CONFIGS = {"deepseek_v3": dict(DS, rope_scaling=YARN), "glm4_moe": dict(GLM, use_qk_norm=True)}


def write_mtp_checkpoint(path, model_type: str, seed: int = 0, own_head: bool = True, **over):
    """A folder with L decoder layers + one MTP module; returns (transformers model with L + 1 layers, tensors)."""
    full = random_hf_model(model_type, seed, **dict(CONFIGS[model_type], num_hidden_layers=L + 1, **over))
    full.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 7)
    D = full.config.hidden_size
    p = f"model.layers.{L}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{p}{name}.weight"] = 1 + 0.2 * torch.randn(D, generator=gen)
    state[f"{p}eh_proj.weight"] = 0.2 * torch.randn(D, 2 * D, generator=gen)
    state[f"{p}embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    head = state["lm_head.weight"]
    state[f"{p}shared_head.head.weight"] = head + 0.3 * torch.randn(head.shape, generator=gen) if own_head else head
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return full, state


def reference_mtp_logits(full, state, hidden, next_ids, positions):
    """The format's definition: eh_proj([enorm(emb(x_{t+1})); hnorm(h_t)]) -> decoder layer -> shared_head."""
    p, eps = f"model.layers.{L}.", full.config.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    emb = state[f"{p}embed_tokens.weight"][next_ids]
    u = F.linear(torch.cat([rms(emb, state[f"{p}enorm.weight"]), rms(hidden, state[f"{p}hnorm.weight"])], -1),
                 state[f"{p}eh_proj.weight"])  # fmt: skip
    with torch.no_grad():
        pe = full.model.rotary_emb(u, positions)
        o = full.model.layers[L](u, attention_mask=None, position_ids=positions, position_embeddings=pe)
    return F.linear(rms(o, state[f"{p}shared_head.norm.weight"]), state[f"{p}shared_head.head.weight"])


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    full, state = write_mtp_checkpoint(path, request.param)
    return path, full, state


def test_forward_matches_the_format_definition(ckpt):
    path, full, state = ckpt
    target = engine.load_model(path)
    mtp = load_checkpoint_mtp(target)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target.forward_batch(pack([chain_item(ids[0], torch.zeros(0, dtype=torch.long), torch.arange(12))],
                                           target.device), _cache(target, 12)).hidden  # fmt: skip
        want = reference_mtp_logits(full, state, hidden[None, :-1], ids[:1, 1:], torch.arange(11)[None])
        got = mtp.logits(mtp.forward(hidden[None, :-1], mtp.embed_tokens(ids[:1, 1:])))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _cache(model, n):
    from engine.models.kv_cache import PagedKVCache

    kv = PagedKVCache.for_model(model.config, -(-n // 16), 16)
    kv.add_sequence(0)
    kv.reserve(0, n)
    return kv


def test_drafter_root_distribution_is_the_module_on_true_features(ckpt):
    """After start(), the drafter's root logits are the module at position n-2 on the target's true features."""
    path, full, state = ckpt
    target = engine.load_model(path)
    drafter = load_mtp_drafter(target)
    tokens = PROMPTS[2]
    n = len(tokens)
    with torch.no_grad():
        hidden = target.logits(torch.tensor([tokens]))  # warm: nothing cached
        out = target.forward_batch(pack([chain_item(tokens, torch.zeros(0, dtype=torch.long), torch.arange(n))],
                                        target.device), _cache(target, n))  # fmt: skip
        hidden = out.hidden
        drafter.prepare([n + 8])
        drafter.start(0, tokens, target_hidden=hidden[: n - 1])
        root = drafter.catch_up([0])[0]
        want = reference_mtp_logits(full, state, hidden[None, : n - 1], torch.tensor([tokens[1:]]),
                                    torch.arange(n - 1)[None])[0, -1]  # fmt: skip
    torch.testing.assert_close(drafter._logits(root[None])[0], want, atol=1e-4, rtol=1e-4)
    drafter.finish(0)
    drafter.kv.check_quiescent()


@pytest.mark.parametrize(
    "spec",
    [engine.SpecConfig(depth=1), engine.SpecConfig(depth=3), engine.SpecConfig(depth=3, width=2, max_verify=8)],
    ids=["K1", "chain-K3", "tree"],
)
def test_greedy_speculation_is_exact(ckpt, spec):
    path, _, _ = ckpt
    target = engine.load_model(path)
    base = engine.Engine(target).generate(PROMPTS, 24)
    res = engine.Engine(target, drafter="mtp", check_kv=True).generate(PROMPTS, 24, spec=spec)
    assert [r.token_ids for r in res] == [r.token_ids for r in base]
    assert sum(s.proposed for r in res for s in r.rounds) > 0


def test_bad_input_is_rejected_before_work(tmp_path):
    full = random_hf_model("deepseek_v3", **CONFIGS["deepseek_v3"])
    full.save_pretrained(tmp_path / "plain")  # config says num_nextn_predict_layers=1, but no MTP tensors
    with pytest.raises(CheckpointError, match="has no MTP weights"):
        engine.Engine(engine.load_model(tmp_path / "plain"), drafter="mtp")
    with pytest.raises(ValueError, match="engine.load_model"):
        engine.Engine(build_model(dict(DS, model_type="deepseek_v3")), drafter="mtp")
    path = tmp_path / "mtp"
    path.mkdir()
    _, state = write_mtp_checkpoint(path, "deepseek_v3")
    for change, match in [("drop", f"missing \\['model.layers.{L}.eh_proj.weight'\\]"),
                          ("add", f"unexpected \\['model.layers.{L}.extra.weight'\\]")]:  # fmt: skip
        broken = dict(state)
        if change == "drop":
            del broken[f"model.layers.{L}.eh_proj.weight"]
        else:
            broken[f"model.layers.{L}.extra.weight"] = torch.zeros(3)
        save_file(broken, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=match):
            engine.Engine(engine.load_model(path), drafter="mtp")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "spec"),
    [
        (
            SamplingParams(temperature=0.7, top_p=0.9, seed=8000),
            engine.SpecConfig(depth=2, width=2, drafted_children=True),
        )
    ],
    ids=["tree-drafted-t0.7-p0.9"],
)
def test_sampling_law_is_the_target_law(tmp_path, params, spec):
    """Chi-square of the first three sampled tokens against the exact target law (test_spec_distribution)."""
    from scipy import stats
    from test_spec_distribution import N, V, exact_law, sample_engine

    full, state = write_mtp_checkpoint(tmp_path, "deepseek_v3", seed=5, vocab_size=V)
    target = engine.load_model(tmp_path)
    law = exact_law(target, params).reshape(-1)
    counts = sample_engine(target, "mtp", params, spec).reshape(-1)
    assert counts.sum() == N and counts[law == 0].sum() == 0
    expected = law * N
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    _, pvalue = stats.chisquare(obs[keep].numpy(), exp[keep].numpy())
    assert pvalue > 1e-6, f"chi-square p = {pvalue:.2e}"
