"""EAGLE and MTP feature-head drafters: exact greedy output, seeded sampling, head-KV alignment, save/load."""

from __future__ import annotations

import pytest
import torch
from hf_configs import tiny_config

import engine
from engine.drafting.feature_drafter import EagleDrafter, MTPDrafter, MTPHead
from engine.drafting.make import load_feature_drafter
from engine.models.batching import chain_item, pack
from engine.models.checkpoint import init_weights
from engine.models.config import parse_config
from engine.models.expert_predictor import ExpertPredictor, ExpertPredictorConfig
from engine.models.feature_heads import EagleHead, HeadConfig, load_eagle_head, load_mtp_head, save_head
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model
from engine.spec.sampling import SamplingParams

PROMPTS = [[5, 7, 9, 11, 3, 5, 7, 9, 11], [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [60]]
SPECS = [
    engine.SpecConfig(depth=4, width=1),
    engine.SpecConfig(depth=3, width=2),
    engine.SpecConfig(depth=5, width=3, max_verify=8),
    engine.SpecConfig(depth=2, width=4, frontier=2),
]
KINDS = {"eagle": (EagleHead, EagleDrafter), "mtp": (MTPHead, MTPDrafter)}


@pytest.fixture(scope="module")
def target() -> Model:
    return init_weights(Model(parse_config(tiny_config("qwen2_moe"))), seed=0, std=0.3).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def heads(target) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    cfg = HeadConfig.for_target(target.config, intermediate_size=64)
    return {"eagle": EagleHead(cfg).eval(), "mtp": MTPHead(cfg).eval()}


@pytest.fixture(scope="module")
def baseline(target) -> list[list[int]]:
    return [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 24)]


def _predictor(target: Model) -> ExpertPredictor:
    torch.manual_seed(1)
    cfg = target.config
    return ExpertPredictor(
        ExpertPredictorConfig(cfg.hidden_size, 32, cfg.num_experts, cfg.top_r, tuple(cfg.moe_layers))
    ).eval()


class AlignmentChecked(EagleDrafter):
    """Proves after every catch-up that the committed head KV and the root feature equal a fresh
    recomputation from the target's features of the committed tokens (no drafted feature leaked)."""

    checks = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.committed: dict[int, list[int]] = {}

    def draft_many(self, requests):
        for seq_id, tokens, *_ in requests:
            self.committed[seq_id] = list(tokens)
        return super().draft_many(requests)

    def catch_up(self, seq_ids: list[int]) -> list[torch.Tensor | None]:
        roots = super().catch_up(seq_ids)
        for seq_id, root in zip(seq_ids, roots):
            self._check(seq_id, root)
        return roots

    def _check(self, seq_id: int, root: torch.Tensor | None) -> None:
        tokens = self.committed[seq_id]
        n = len(tokens) - 1  # head positions 0..n-1: inputs (f_t, x_{t+1})
        assert self.seqs[seq_id].cached == n
        if n == 0:
            assert root is None
            return
        t, h = self.target, self.head
        tkv = PagedKVCache(t.config.num_layers, t.config.num_kv_heads, t.config.head_dim, -(-n // 16), 16)
        tkv.add_sequence(0)
        tkv.reserve(0, n)
        s = tkv.slots(0, range(n))
        features = t.forward_batch(pack([chain_item(tokens[:n], s[:0], s)], t.device), tkv).hidden  # f_0..f_{n-1}
        hkv = PagedKVCache(1, h.config.num_kv_heads, h.config.head_dim, -(-n // 16), 16)
        hkv.add_sequence(0)
        hkv.reserve(0, n)
        batch = pack([chain_item(tokens[1:], s[:0], s)], t.device)
        fresh = h.forward_cached(features, t.model.embed_tokens(batch.input_ids), batch, hkv)
        torch.testing.assert_close(root, fresh[-1], atol=1e-4, rtol=1e-4)
        plain = h(features[None], t.model.embed_tokens(torch.tensor(tokens[1:]))[None])[0]  # the training path
        torch.testing.assert_close(root, plain[-1], atol=1e-4, rtol=1e-4)
        mine = self.kv.slots(seq_id, range(n))
        torch.testing.assert_close(self.kv.k[0, mine], hkv.k[0, s], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(self.kv.v[0, mine], hkv.v[0, s], atol=1e-4, rtol=1e-4)
        AlignmentChecked.checks += 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"K{s.depth}W{s.width}")
def test_greedy_equals_target_only(target, heads, baseline, kind, spec):
    drafter = KINDS[kind][1](heads[kind], target)
    eng = engine.Engine(target, drafter=drafter, check_kv=True)
    res = eng.generate(PROMPTS, 24, spec=spec)
    assert [r.token_ids for r in res] == baseline
    eng.kv.check_quiescent()
    drafter.kv.check_quiescent()
    assert not drafter.seqs


@pytest.mark.parametrize("kind", KINDS)
def test_head_kv_stays_aligned_through_accepts_and_rejects(target, heads, kind):
    # Near-uniform target and drafter laws (temperature 5): most drafted children are accepted, some are
    # rejected, so every commit path (accepted rows, recovered, bonus, finish mid-round) is exercised.
    drafter = AlignmentChecked(heads[kind], target, block_size=4)
    eng = engine.Engine(target, drafter=drafter, block_size=4)
    AlignmentChecked.checks = 0
    res = eng.generate(PROMPTS, 20, sampling=SamplingParams(temperature=5.0, seed=3),
                       spec=engine.SpecConfig(depth=3, width=1))  # fmt: skip
    rounds = [r for x in res for r in x.rounds]
    assert sum(r.accepted for r in rounds) > 10 and any(r.accepted < r.proposed for r in rounds)
    greedy = eng.generate(PROMPTS, 12, spec=engine.SpecConfig(depth=3, width=2))
    assert AlignmentChecked.checks >= len(rounds) and all(len(x.token_ids) == 12 for x in greedy)
    drafter.kv.check_quiescent()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: f"K{s.depth}W{s.width}")
def test_seeded_sampling_is_bit_identical(target, heads, kind, spec):
    drafter = KINDS[kind][1](heads[kind], target)
    eng = engine.Engine(target, drafter=drafter, check_kv=True)
    params = [SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=7 + i) for i in range(len(PROMPTS))]
    a = eng.generate(PROMPTS, 20, sampling=params, spec=spec)
    b = eng.generate(PROMPTS, 20, sampling=params, spec=spec)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert eng.generate([PROMPTS[2]], 20, sampling=[params[2]], spec=spec)[0].token_ids == a[2].token_ids
    eng.kv.check_quiescent()
    drafter.kv.check_quiescent()


def test_drafted_children_carry_their_draft_law(target, heads):
    drafter = EagleDrafter(heads["eagle"], target)
    tokens = PROMPTS[0]
    features = target.forward_batch(*_prefill(target, tokens)).hidden
    drafter.start(0, tokens, features)
    tree = drafter.draft(0, tokens, engine.SpecConfig(depth=3, width=1), SamplingParams(temperature=1.0),
                         torch.Generator().manual_seed(0))  # fmt: skip
    assert tree.draft_probs is not None and tree.draft_probs.shape == (tree.num_nodes, target.vocab_size)
    for i in range(1, tree.num_nodes):  # each child was drawn from its parent's row: positive mass
        assert tree.draft_probs[tree.parents[i], tree.tokens[i]] > 0
    drafter.finish(0)
    drafter.kv.check_quiescent()


def _prefill(target: Model, tokens: list[int]):
    n = len(tokens) - 1
    kv = PagedKVCache(target.config.num_layers, target.config.num_kv_heads, target.config.head_dim, 4, 16)
    kv.add_sequence(0)
    kv.reserve(0, n)
    s = kv.slots(0, range(n))
    return pack([chain_item(tokens[:n], s[:0], s)], target.device), kv


def test_expert_aware_selection_with_a_predictor(target, heads, baseline):
    predictor = _predictor(target)
    drafter = EagleDrafter(heads["eagle"], target, predictor)
    tokens = PROMPTS[2]
    drafter.start(0, tokens, target.forward_batch(*_prefill(target, tokens)).hidden)
    spec = engine.SpecConfig(depth=3, width=3, frontier=3, lam=0.5, max_verify=6)
    tree = drafter.draft(0, tokens, spec, SamplingParams(), torch.Generator())
    L, E, r = len(target.config.moe_layers), target.config.num_experts, target.config.top_r
    assert tree.predicted_experts.shape == (tree.num_nodes, L, E) and tree.predicted_experts.dtype == torch.bool
    assert bool((tree.predicted_experts.sum(-1) == r).all())
    assert 1 <= tree.num_nodes <= 7 and bool((tree.parents[1:] < torch.arange(1, tree.num_nodes)).all())
    drafter.finish(0)
    eng = engine.Engine(target, drafter=EagleDrafter(heads["eagle"], target, predictor), check_kv=True)
    assert [r.token_ids for r in eng.generate(PROMPTS, 24, spec=spec)] == baseline


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_roundtrip(target, heads, kind, tmp_path):
    head = heads[kind]
    save_head(head, tmp_path / kind, target)
    loaded = (load_eagle_head if kind == "eagle" else load_mtp_head)(tmp_path / kind, target)
    assert type(loaded) is type(head)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)
    with pytest.raises(ValueError, match="expertspec_"):
        (load_mtp_head if kind == "eagle" else load_eagle_head)(tmp_path / kind, target)
    drafter = load_feature_drafter(tmp_path / kind, target)
    assert type(drafter) is KINDS[kind][1] and type(drafter.head) is type(head)


def test_heads_refuse_another_target_checkpoint(target, heads, tmp_path):
    engine.save_model(target, tmp_path / "target")
    on_disk = engine.load_model(tmp_path / "target")
    save_head(heads["eagle"], tmp_path / "head", on_disk)
    same = load_eagle_head(tmp_path / "head", on_disk)  # the checkpoint it was saved against: loads, same weights
    for (name, a), (_, b) in zip(heads["eagle"].state_dict().items(), same.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)
    retrained = init_weights(Model(parse_config(tiny_config("qwen2_moe"))), seed=1, std=0.3)
    engine.save_model(retrained, tmp_path / "target")
    with pytest.raises(ValueError, match="another target checkpoint"):
        load_eagle_head(tmp_path / "head", engine.load_model(tmp_path / "target"))
