"""Published EAGLE-3 heads (`LlamaForCausalLMEagle3`, the SpecForge / SGLang / vLLM layout) over an MoE target.

Heads are written in the published layout with random weights; the forward is checked against a reference
written here from the format's definition, the target's auxiliary states against transformers'
`hidden_states`, and greedy speculation for exactness (sampling law: chi-square, slow)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from family_ckpt import PROMPTS, save_pair
from hf_configs import tiny_config
from safetensors.torch import save_file

import engine
from engine.drafting.eagle3_drafter import load_eagle3_drafter
from engine.models.batching import chain_item, pack
from engine.models.eagle3 import Eagle3Error
from engine.models.kv_cache import PagedKVCache
from engine.spec.sampling import SamplingParams

TARGET_LAYERS = 6
HEAD = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=48, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_hidden_layers=1, vocab_size=97,
            draft_vocab_size=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
            tie_word_embeddings=False, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4],
                                                     "use_aux_hidden_state": True})  # fmt: skip


def write_head(path, seed: int = 0, vocab: int = 97, draft_vocab: int = 32, **over) -> dict[str, torch.Tensor]:
    """A head folder in the published layout (random weights); returns its tensors."""
    cfg = dict(HEAD, vocab_size=vocab, draft_vocab_size=draft_vocab, **over)
    gen = torch.Generator().manual_seed(seed)
    D, H, Hkv, hd, Fi, Dt = 48, 4, 2, 12, 64, cfg.get("target_hidden_size", 48)

    def w(*shape):
        return torch.randn(shape, generator=gen) * 0.2

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=gen)

    target_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    state = {
        "fc.weight": w(D, 3 * Dt), "norm.weight": norm(D), "lm_head.weight": w(draft_vocab, D) * 3,
        "midlayer.input_layernorm.weight": norm(D), "midlayer.hidden_norm.weight": norm(D),
        "midlayer.post_attention_layernorm.weight": norm(D),
        "midlayer.self_attn.q_proj.weight": w(H * hd, 2 * D), "midlayer.self_attn.k_proj.weight": w(Hkv * hd, 2 * D),
        "midlayer.self_attn.v_proj.weight": w(Hkv * hd, 2 * D), "midlayer.self_attn.o_proj.weight": w(D, H * hd),
        "midlayer.mlp.gate_proj.weight": w(Fi, D), "midlayer.mlp.up_proj.weight": w(Fi, D),
        "midlayer.mlp.down_proj.weight": w(D, Fi),
        "d2t": target_ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True),
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))
    return state


def reference_steps(w, embed, g, next_ids, norm_before_residual=False):
    """The format's definition: g [T, D] features, next_ids [T] -> pre-norm p [T, D], target logits [T, V]."""

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    T, H, Hkv, hd = g.shape[0], 4, 2, 12
    x = torch.cat([rms(embed[next_ids], w["midlayer.input_layernorm.weight"]),
                   rms(g, w["midlayer.hidden_norm.weight"])], dim=-1)  # fmt: skip
    q, k, v = (F.linear(x, w[f"midlayer.self_attn.{n}_proj.weight"]).view(T, -1, hd) for n in "qkv")
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, H * hd)
    r = (rms(g, w["midlayer.hidden_norm.weight"]) if norm_before_residual else g) + F.linear(
        attn, w["midlayer.self_attn.o_proj.weight"]
    )
    h = rms(r, w["midlayer.post_attention_layernorm.weight"])
    act = F.silu(F.linear(h, w["midlayer.mlp.gate_proj.weight"])) * F.linear(h, w["midlayer.mlp.up_proj.weight"])
    p = r + F.linear(act, w["midlayer.mlp.down_proj.weight"])
    draft = F.linear(rms(p, w["norm.weight"]), w["lm_head.weight"])
    full = torch.full((T, embed.shape[0]), float("-inf"))
    full[:, torch.arange(draft.shape[1]) + w["d2t"]] = draft
    return p, full


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    cfg = tiny_config("qwen3_moe", num_hidden_layers=TARGET_LAYERS)
    del cfg["model_type"]
    ref, target = save_pair("qwen3_moe", root / "target", seed=1, **cfg)
    state = write_head(root / "head")
    return ref, target, root / "head", state


def _features(target, tokens, layers):
    n = len(tokens)
    kv = PagedKVCache.for_model(target.config, -(-n // 16), 16)
    kv.add_sequence(0)
    kv.reserve(0, n)
    slots = kv.slots(0, range(n))
    with torch.inference_mode():
        return target.forward_batch(pack([chain_item(tokens, slots[:0], slots)], target.device), kv,
                                    feature_layers=layers)  # fmt: skip


def test_auxiliary_states_are_transformers_hidden_states(setup):
    ref, target, head_dir, _ = setup
    drafter = load_eagle3_drafter(head_dir, target)
    assert drafter.feature_layers == (1, 3, 5)  # layer ids 0, 2, 4 -> the inputs of layers 1, 3, 5
    tokens = PROMPTS[2]
    out = _features(target, tokens, drafter.feature_layers)
    with torch.no_grad():
        hs = ref(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.features, torch.cat([hs[c][0] for c in (1, 3, 5)], -1), atol=1e-4, rtol=1e-4)


def test_forward_matches_the_format_definition(setup):
    _, target, head_dir, w = setup
    drafter = load_eagle3_drafter(head_dir, target)
    head = drafter.head
    g = torch.randn(9, 48, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(3))
    embed = target.model.embed_tokens.weight.detach()
    p_ref, logits_ref = reference_steps(w, embed, g, ids)
    with torch.no_grad():
        p = head(g[None], head.embed_tokens(ids)[None])[0]
        torch.testing.assert_close(p, p_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.target_logits(p), logits_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.fuse_target(torch.ones(2, 144)), F.linear(torch.ones(2, 144), w["fc.weight"]))


def test_norm_before_residual_variant(setup, tmp_path):
    _, target, _, _ = setup
    w = write_head(tmp_path, norm_before_residual=True)
    head = load_eagle3_drafter(tmp_path, target).head
    g = torch.randn(7, 48, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(6))
    p_ref, _ = reference_steps(w, target.model.embed_tokens.weight.detach(), g, ids, norm_before_residual=True)
    with torch.no_grad():
        torch.testing.assert_close(head(g[None], head.embed_tokens(ids)[None])[0], p_ref, atol=1e-4, rtol=1e-4)


def test_drafter_root_and_chained_child_follow_the_definition(setup):
    """Root: the head at position n-2 on fc(true target states); depth 2: fed the root's pre-norm output."""
    _, target, head_dir, w = setup
    drafter = load_eagle3_drafter(head_dir, target)
    tokens = PROMPTS[2]
    n = len(tokens)
    aux = _features(target, tokens[:-1], drafter.feature_layers).features  # [n-1, 3D]
    embed = target.model.embed_tokens.weight.detach()
    g = F.linear(aux, w["fc.weight"])
    p_ref, logits_ref = reference_steps(w, embed, g, torch.tensor(tokens[1:]))
    drafter.prepare([n + 8])
    drafter.start(0, tokens, target_hidden=aux)
    tree = drafter.draft(0, tokens, engine.SpecConfig(depth=2, width=1), SamplingParams(), torch.Generator())
    child = int(logits_ref[-1].argmax())
    assert tree.tokens[1] == child
    _, logits2 = reference_steps(w, embed, torch.cat([g, p_ref[-1:]]), torch.tensor(tokens[1:] + [child]))
    assert tree.tokens[2] == int(logits2[-1].argmax())
    drafter.finish(0)


@pytest.mark.parametrize(
    "spec",
    [engine.SpecConfig(depth=1), engine.SpecConfig(depth=4), engine.SpecConfig(depth=3, width=2, max_verify=8)],
    ids=["K1", "chain-K4", "tree"],
)
def test_greedy_speculation_is_exact(setup, spec):
    _, target, head_dir, _ = setup
    base = engine.Engine(target).generate(PROMPTS, 24)
    res = engine.Engine(target, drafter=str(head_dir), check_kv=True).generate(PROMPTS, 24, spec=spec)
    assert [r.token_ids for r in res] == [r.token_ids for r in base]
    assert sum(s.proposed for r in res for s in r.rounds) > 0


def test_default_auxiliary_layers_and_missing_optional_maps(setup, tmp_path):
    """Without layer ids: SGLang / vLLM's [2, L//2, L-3]; without d2t / t2d on a full draft vocabulary: identity."""
    _, target, _, _ = setup
    state = write_head(tmp_path, draft_vocab=97, eagle_config={})
    for key in ("d2t", "t2d"):
        del state[key]
    save_file(state, str(tmp_path / "model.safetensors"))
    drafter = load_eagle3_drafter(tmp_path, target)
    assert drafter.feature_layers == (2, 3, 3)
    assert torch.equal(drafter.head.d2t, torch.zeros(97, dtype=torch.long))


@pytest.mark.parametrize(
    ("over", "edit", "match"),
    [
        (dict(vocab=98, draft_vocab=32), None, "vocabulary \\(98\\) differs"),
        (dict(target_hidden_size=40), None, "target hidden states of size 40"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}), None, "do not fit a target"),
        (dict(num_hidden_layers=2), None, "with 2 layers"),
        ({}, lambda s: s.pop("fc.weight"), "missing \\['fc.weight'\\]"),
        ({}, lambda s: s.update({"midlayer.extra.weight": torch.zeros(2)}), "unexpected \\['midlayer.extra.weight'\\]"),
        ({}, lambda s: s.update({"d2t": torch.zeros(32, dtype=torch.long) - 1}), "d2t must map"),
        ({}, lambda s: s.update({"t2d": torch.ones(97, dtype=torch.bool)}), "t2d does not mark"),
        ({}, lambda s: s.update({"norm.weight": torch.ones(40)}), "shape mismatch for norm.weight"),
    ],
)
def test_heads_that_do_not_fit_are_rejected_before_work(setup, tmp_path, over, edit, match):
    _, target, _, _ = setup
    state = write_head(tmp_path, **over)
    if edit is not None:
        edit(state)
        save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(Eagle3Error, match=match):
        engine.Engine(target, drafter=str(tmp_path))


@pytest.mark.slow
def test_sampling_law_is_the_target_law(tmp_path):
    from scipy import stats
    from test_spec_distribution import N, V, exact_law, sample_engine

    cfg = tiny_config("qwen3_moe", num_hidden_layers=TARGET_LAYERS, vocab_size=V)
    del cfg["model_type"]
    _, target = save_pair("qwen3_moe", tmp_path / "target", seed=2, **cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    write_head(tmp_path / "head", vocab=V, draft_vocab=5)
    params = SamplingParams(temperature=1.0, seed=9000)
    law = exact_law(target, params).reshape(-1)
    spec = engine.SpecConfig(depth=2, width=2, drafted_children=True)
    counts = sample_engine(target, str(tmp_path / "head"), params, spec).reshape(-1)
    assert counts.sum() == N and counts[law == 0].sum() == 0
    expected = law * N
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    _, pvalue = stats.chisquare(obs[keep].numpy(), exp[keep].numpy())
    assert pvalue > 1e-6, f"chi-square p = {pvalue:.2e}"
