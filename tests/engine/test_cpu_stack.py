"""The whole-forward CPU call (`engine.models.cpu_stack`, kernels/decoder_stack.h) against the per-op path it replaces:
the same bits for logits, hidden states, EAGLE-3 features, routing and the K/V it writes, over chains, trees and
several padded requests; the per-op path wherever the stack does not apply; rebuilt when weights change."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hf_configs import tiny_config

import engine
from engine.models import transformer
from engine.models.batching import chain_item, pack, tree_item
from engine.models.checkpoint import build_model
from engine.models.cpu_stack import CpuStack, _Refused
from engine.models.kv_cache import PagedKVCache
from engine.models.layout import use_decode_layout
from engine.timing import PhaseTimer
from kernels import cpu_decode, small_m

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason=f"fused CPU ops {cpu_decode.status()}")

CASES = [  # shared expert (gated, qkv bias), top-1 tied, per-head qk-norm, GQA 4/4, no shared expert, top-3
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(num_experts_per_tok=1, norm_topk_prob=True, tie_word_embeddings=True)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(num_experts_per_tok=3, norm_topk_prob=True, num_key_value_heads=4)),
    ("mixtral", {}),
    ("mixtral", dict(num_experts_per_tok=1, tie_word_embeddings=True)),
    ("olmoe", {}),  # qk-norm over the whole q and k projections
]


@contextlib.contextmanager
def per_op():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXPERTSPEC_LAYER_STACK", "0")
        yield


@contextlib.contextmanager
def packing(on: bool):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(small_m._packs, "on", on)
        yield


@contextlib.contextmanager
def no_per_op_attention():
    """Fails any forward that takes the per-op path (its attention)."""

    def boom(*args, **kwargs):
        raise AssertionError("the per-op path ran")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformer.Attention, "forward_cached", boom)
        yield


def model_of(model_type: str, over: dict, seed: int = 0):
    """A tiny random model in the layout `engine.load_model` gives on CPU (`use_decode_layout`)."""
    model = use_decode_layout(build_model(tiny_config(model_type, **over), seed=seed))
    with torch.no_grad():  # sharper routing than the init: token-dependent expert choices
        for block in model.moe_blocks:
            block.gate.weight.mul_(8.0)
    return model


def batch_of(model, shape: str, seed: int = 0):
    """A fresh cache and a forward batch: "chain-N" (one request, N tokens after 7 of context) or "mixed" (a 5-token
    chain, a 6-node tree and a 1-token decode, padded into one batch)."""
    cfg = model.config
    kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 8, dtype=model.dtype)
    g = torch.Generator().manual_seed(seed)
    items = []

    def context(rid: int, c: int, n: int):
        kv.add_sequence(rid)
        kv.reserve(rid, c + n)
        slots = kv.slots(rid, range(c + n))
        with torch.inference_mode():  # the context's K/V, written by a cached forward
            toks = torch.randint(0, cfg.vocab_size, (c,), generator=g)
            model.forward_batch(pack([chain_item(toks, slots[:0], slots[:c])], model.device), kv)
        return slots[:c], slots[c:]

    if shape.startswith("chain-"):
        n = int(shape.split("-")[1])
        ctx, new = context(0, 7, n)
        items.append(chain_item(torch.randint(0, cfg.vocab_size, (n,), generator=g), ctx, new))
    else:
        ctx, new = context(0, 4, 5)
        items.append(chain_item(torch.randint(0, cfg.vocab_size, (5,), generator=g), ctx, new))
        ctx, new = context(1, 9, 6)
        parents, depths = torch.tensor([-1, 0, 0, 1, 1, 2]), torch.tensor([0, 1, 1, 2, 2, 2])
        items.append(tree_item(torch.randint(0, cfg.vocab_size, (6,), generator=g), parents, depths, ctx, new))
        ctx, new = context(2, 3, 1)
        items.append(chain_item(torch.randint(0, cfg.vocab_size, (1,), generator=g), ctx, new))
    return pack(items, model.device), kv


def run(model, batch, kv, **kwargs):
    """(output, K storage, V storage) of one forward over a copy of the cache."""
    k, v = kv.k.clone(), kv.v.clone()
    saved = kv.k, kv.v
    kv.k, kv.v = k, v
    try:
        with torch.inference_mode():
            out = model.forward_batch(batch, kv, **kwargs)
    finally:
        kv.k, kv.v = saved
    return out, k, v


def assert_same(a, b):
    ((oa, ka, va), (ob, kb, vb)) = a, b
    for x, y in ((oa.logits, ob.logits), (oa.hidden, ob.hidden), (oa.pre_norm_hidden, ob.pre_norm_hidden), (ka, kb),
                 (va, vb)):  # fmt: skip
        assert torch.equal(x, y)
    assert (oa.features is None) == (ob.features is None)
    if oa.features is not None:
        assert torch.equal(oa.features, ob.features)
    assert (oa.routing is None) == (ob.routing is None)
    if oa.routing is not None:
        ra, rb = oa.routing, ob.routing
        assert ra.layers == rb.layers
        for xs, ys in ((ra.expert_ids, rb.expert_ids), (ra.topk_weights, rb.topk_weights),
                       (ra.router_logits, rb.router_logits)):  # fmt: skip
            assert len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


@pytest.mark.parametrize(("model_type", "over"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_stack_gives_the_per_op_bits(model_type, over, packed):
    """Logits, hidden states, features, routing (ids, weights, router logits) and the written K/V: equal bit for bit,
    for chains of 1 to 32 tokens, a tree and three padded requests, with the weights packed or swept in place."""
    with packing(packed):
        model = model_of(model_type, over)
        L = model.config.num_layers
        for shape in ("chain-1", "chain-3", "chain-16", "chain-17", "chain-32", "mixed"):
            batch, kv = batch_of(model, shape)
            kwargs = dict(record_routing=True, keep_router_logits=True, feature_layers=(L, 0, 1))
            with per_op():
                want = run(model, batch, kv, **kwargs)
            with no_per_op_attention():
                got = run(model, batch, kv, **kwargs)
            assert_same(got, want)
            with per_op():
                want = run(model, batch, kv)  # nothing recorded or captured
            assert_same(run(model, batch, kv), want)
            assert isinstance(model.__dict__["_cpu_stack"], CpuStack)


def test_the_per_op_path_runs_where_the_stack_does_not_apply():
    """A phase timer, an active expert budget, an expert_fn (EP / offload), the Triton backend, more than 32 tokens,
    autograd, EXPERTSPEC_LAYER_STACK=0: the per-op path, with the same results where both run."""
    model = model_of("qwen2_moe", {})
    batch, kv = batch_of(model, "chain-4")
    want = run(model, batch, kv)
    calls = []
    real = transformer.Attention.forward_cached

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformer.Attention, "forward_cached", counted)
        assert torch.equal(run(model, batch, kv)[0].logits, want[0].logits) and not calls  # the stack
        assert torch.equal(run(model, batch, kv, timer=PhaseTimer())[0].logits, want[0].logits) and calls
        calls.clear()
        run(model, batch, kv, expert_budget=model.config.top_r)  # approximate: routing changes
        assert calls
        calls.clear()
        assert torch.equal(run(model, batch, kv, expert_budget=model.config.num_experts)[0].logits, want[0].logits)
        assert not calls  # a budget of every expert changes nothing: the stack
        block = model.moe_blocks[0]
        block.expert_fn = block.local_experts
        run(model, batch, kv)
        block.expert_fn = None
        assert calls
        calls.clear()
        with per_op():
            run(model, batch, kv)
        assert calls
        calls.clear()
        big, big_kv = batch_of(model, "chain-33")
        run(model, big, big_kv)
        assert calls
        calls.clear()
        fresh = model_of("qwen2_moe", {})  # no inference-mode caches yet
        cfg = fresh.config
        kv2 = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, 8)
        kv2.add_sequence(0)
        kv2.reserve(0, 3)
        slots = kv2.slots(0, range(3))
        fresh.forward_batch(pack([chain_item([1, 2, 3], slots[:0], slots)], fresh.device), kv2)  # autograd on
        assert calls


def test_the_stack_follows_weight_updates_and_the_packing_switch():
    model = model_of("qwen3_moe", {})
    batch, kv = batch_of(model, "chain-5")
    before = run(model, batch, kv)[0].logits
    stack = model.__dict__["_cpu_stack"]
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj.mul_(1.5)  # in place: a new version
    after = run(model, batch, kv)[0].logits
    assert model.__dict__["_cpu_stack"] is not stack and not torch.equal(before, after)
    with per_op():
        assert torch.equal(run(model, batch, kv)[0].logits, after)
    stack = model.__dict__["_cpu_stack"]
    with packing(not small_m._packs["on"]):
        run(model, batch, kv)
        assert model.__dict__["_cpu_stack"] is not stack
    model.model.layers[0].input_layernorm.weight = torch.nn.Parameter(torch.full((48,), 2.0))  # new storage
    with per_op():
        want = run(model, batch, kv)[0].logits
    assert torch.equal(run(model, batch, kv)[0].logits, want)


@pytest.mark.parametrize(
    ("model_type", "over"),
    [("qwen2_moe", dict(mlp_only_layers=[0])), ("olmoe", dict(clip_qkv=0.5))],
    ids=["dense-layer", "qkv-clip"],
)
def test_models_the_stack_does_not_take(model_type, over):
    """A dense MLP layer, a qkv clip: never built, the per-op path runs."""
    model = model_of(model_type, over)
    batch, kv = batch_of(model, "chain-3")
    run(model, batch, kv)
    assert model.__dict__["_cpu_stack"] is False


def test_row_major_weights_and_a_dtype_change():
    """Weights as `build_model` leaves them (row-major, which the small-M sweep does not read: F.linear's BLAS, or the
    packed copies): the per-op bits. A bf16 model: the per-op path, and the stack again once it is fp32."""
    for packed in (True, False):
        with packing(packed):
            model = build_model(tiny_config("qwen3_moe"), seed=2)
            for shape in ("chain-3", "chain-20"):
                batch, kv = batch_of(model, shape)
                with per_op():
                    want = run(model, batch, kv, record_routing=True)
                with no_per_op_attention():
                    assert_same(run(model, batch, kv, record_routing=True), want)
    model.to(torch.bfloat16)
    batch, kv = batch_of(model, "chain-3")
    run(model, batch, kv)
    assert isinstance(model.__dict__["_cpu_stack"], _Refused)
    model.to(torch.float32)
    batch, kv = batch_of(model, "chain-3")
    with no_per_op_attention():
        run(model, batch, kv)
    assert isinstance(model.__dict__["_cpu_stack"], CpuStack)


def test_the_native_call_checks_its_input():
    model = model_of("mixtral", {})
    batch, kv = batch_of(model, "chain-2")
    run(model, batch, kv)
    stack = model.__dict__["_cpu_stack"].native
    h = torch.zeros(2, model.config.hidden_size)
    cos, sin = model._rope_table(torch.float32)
    args = [h, batch.positions, cos, sin, kv.k, kv.v, batch.write_slots, batch.pad_index, batch.read_slots,
            batch.attn_mask.contiguous(), [], False, False]  # fmt: skip
    bad = list(args)
    bad[8] = batch.read_slots + kv.k.shape[1]
    with pytest.raises(RuntimeError, match="DecoderStack: read slot out of range"):
        stack.forward(*bad)
    bad = list(args)
    bad[1] = batch.positions + 10_000
    with pytest.raises(RuntimeError, match="position out of the RoPE table"):
        stack.forward(*bad)
    bad = list(args)
    bad[4] = kv.k[:1]
    with pytest.raises(RuntimeError, match=r"k / v cache storage \[L, slots, Hkv, hd\]"):
        stack.forward(*bad)


def test_engine_tokens_with_the_stack_equal_the_per_op_path():
    """The zoo target with its EAGLE head: greedy tokens target-only and speculative (chains and trees), batched."""
    from engine.paths import zoo_path
    from engine.workloads import code_prompts, encode

    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(3), 32)
    eng = engine.Engine(target, drafter=zoo_path("eagle-head"), timing=False)

    def tokens():
        return [[r.token_ids for r in eng.generate(prompts, 24, spec=s)]
                for s in (None, engine.SpecConfig(depth=4), engine.SpecConfig(depth=3, width=2))]  # fmt: skip

    got = tokens()
    assert isinstance(target.__dict__["_cpu_stack"], CpuStack)
    with per_op():
        assert tokens() == got
    assert got[1] == got[0] and got[2] == got[0]


@pytest.mark.parametrize(("model_type", "over"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_stack_matches_the_plain_torch_forward(model_type, over):
    """A cached prompt of 20 tokens through the stack = `Model.logits`'s torch ops to 1e-5 (the family's reference,
    itself matched to transformers in test_model_parity)."""
    model = model_of(model_type, over, seed=4)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16)
    kv.add_sequence(0)
    kv.reserve(0, 20)
    slots = kv.slots(0, range(20))
    with no_per_op_attention(), torch.inference_mode():
        got = model.forward_batch(pack([chain_item(ids[0], slots[:0], slots)], model.device), kv).logits
    torch.testing.assert_close(got, model.logits(ids)[0], rtol=1e-5, atol=1e-5)
