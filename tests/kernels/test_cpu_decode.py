"""The fused CPU decode ops (kernels.cpu_decode) against their torch twins, and the engine with them on / off."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.models.kv_cache import PagedKVCache
from engine.models.layers import RMSNorm, add_norm, sign_sin
from engine.models.layout import input_major
from engine.models.transformer import Attention, ForwardBatch, rope_cos_sin
from engine.paths import zoo_path
from kernels import cpu_decode, small_m

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason=f"fused CPU decode ops {cpu_decode.status()}")


@contextlib.contextmanager
def fused_off():
    """Every fused op falls back to its torch twin inside the block."""
    saved = dict(cpu_decode._EXT.state)
    cpu_decode._EXT.state.update(module=None, status="off (test)")
    try:
        yield
    finally:
        cpu_decode._EXT.state.update(saved)


def _config(H, Hkv, hd, qk_norm, bias):
    cfg = engine.load_model(zoo_path("tiny-moe")).config
    return replace(cfg, hidden_size=96, num_heads=H, num_kv_heads=Hkv, head_dim=hd, qk_norm=qk_norm, qkv_bias=bias)


@pytest.mark.parametrize(
    "H, Hkv, hd, qk_norm, bias, rd",
    [
        (4, 2, 64, "none", False, 64),
        (8, 2, 32, "head", False, 32),
        (4, 4, 48, "none", True, 16),
        (6, 3, 40, "head", True, 40),
    ],
)
@pytest.mark.parametrize("n, masked", [(1, False), (3, True), (9, True), (16, False)])
def test_attention_equals_the_torch_path(H, Hkv, hd, qk_norm, bias, rd, n, masked):
    """Output and the K/V written, over paged (shuffled) read slots, with a tree-like mask or none."""
    g = torch.Generator().manual_seed(H * 100 + hd + n)
    attn = Attention(_config(H, Hkv, hd, qk_norm, bias)).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    S, slots = 40 + n, 96
    kv = PagedKVCache(1, Hkv, hd, num_blocks=slots // 16, block_size=16)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    read = torch.randperm(slots, generator=g)[:S]
    write = read[-n:]
    mask = torch.rand(n, S, generator=g) < 0.6
    mask[:, -n:] = torch.eye(n, dtype=torch.bool) | mask[:, -n:]  # every query sees its own key
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long), torch.arange(n), torch.arange(n)[None], write, read[None],
                         mask[None] if masked else None)  # fmt: skip
    cos, sin = rope_cos_sin(torch.arange(S - n, S), rd, 10000.0, torch.float32)
    x = torch.randn(n, 96, generator=g)
    k0, v0 = kv.k.clone(), kv.v.clone()
    with torch.inference_mode():
        assert attn._fused_cpu(x, kv)
        out = attn.forward_cached(x, cos, sign_sin(sin), batch, kv, 0)
        k1, v1 = kv.k.clone(), kv.v.clone()
        kv.k.copy_(k0), kv.v.copy_(v0)
        with fused_off():
            assert not attn._fused_cpu(x, kv)
            ref = attn.forward_cached(x, cos, sign_sin(sin), batch, kv, 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(k1, kv.k, rtol=1e-5, atol=1e-5 * float(kv.k.abs().max()))
    assert torch.equal(v1, kv.v)


@pytest.mark.parametrize("qk_norm", ["none", "head"])
def test_batched_attention_equals_the_torch_path(qk_norm):
    """B = 3 requests of 1, 4 and 2 tokens packed with padding (engine.models.batching.pack), masks or none."""
    from engine.models.batching import PackItem, pack

    g = torch.Generator().manual_seed(7)
    H, Hkv, hd = 4, 2, 32
    attn = Attention(_config(H, Hkv, hd, qk_norm, False)).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    kv = PagedKVCache(1, Hkv, hd, num_blocks=8, block_size=16)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    free = torch.randperm(128, generator=g)
    items, used = [], 0
    for n, ctx, masked in ((1, 20, False), (4, 33, True), (2, 9, True)):
        read = free[used : used + ctx + n]
        used += ctx + n
        mask = None
        if masked:
            mask = torch.rand(n, ctx + n, generator=g) < 0.7
            mask[:, ctx:] = torch.eye(n, dtype=torch.bool)
        items.append(PackItem(torch.zeros(n, dtype=torch.long), torch.arange(ctx, ctx + n), read[ctx:], read, mask))
    batch = pack(items, torch.device("cpu"))
    cos, sin = rope_cos_sin(batch.positions, hd, 10000.0, torch.float32)
    x = torch.randn(batch.num_tokens, 96, generator=g)
    k0, v0 = kv.k.clone(), kv.v.clone()
    with torch.inference_mode():
        out = attn.forward_cached(x, cos, sign_sin(sin), batch, kv, 0)
        k1 = kv.k.clone()
        kv.k.copy_(k0), kv.v.copy_(v0)
        with fused_off():
            ref = attn.forward_cached(x, cos, sign_sin(sin), batch, kv, 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(k1, kv.k, rtol=1e-5, atol=1e-5 * float(kv.k.abs().max()))


def test_add_norm_equals_the_torch_ops():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(80, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(80, generator=g))
    for n in (1, 5, 16):
        h, d = torch.randn(n, 80, generator=g), torch.randn(n, 80, generator=g)
        with torch.inference_mode():
            s, x = add_norm(norm, h, d)
            s0, x0 = add_norm(norm, h, None)
        assert torch.equal(s, h + d) and s0 is h
        torch.testing.assert_close(x, F.rms_norm(h + d, (80,), norm.weight, 1e-6), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x0, F.rms_norm(h, (80,), norm.weight, 1e-6), rtol=1e-5, atol=1e-5)


def test_falls_back_where_it_does_not_apply():
    norm = RMSNorm(8, 1e-6)
    h = torch.randn(2, 8, requires_grad=True)
    s, x = add_norm(norm, h, None)  # autograd: the torch ops
    x.sum().backward()
    assert h.grad is not None
    assert not cpu_decode.applies(torch.randn(2, 8).double())
    with fused_off():
        assert not cpu_decode.applies(torch.randn(2, 8))


def test_bad_inputs_are_refused_with_a_message():
    kc = torch.zeros(32, 2, 16)
    args = (torch.zeros(1, 16), torch.zeros(1, 16), None, None, 0.0, kc, kc.clone())
    one = torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="proj width"):
        cpu_decode.attention(torch.zeros(1, 100), *args, torch.tensor([0]), one, one, None, 4, 2)
    with pytest.raises(RuntimeError, match="read slot out of range"):
        cpu_decode.attention(torch.zeros(1, 128), *args, torch.tensor([0]), one, torch.tensor([[99]]), None, 4, 2)


def test_engine_logits_and_greedy_tokens_with_and_without_them(same_engine_output_on_and_off):
    """Same logits to 1e-5 and the same greedy tokens, target-only and speculative, fused ops on and off."""
    same_engine_output_on_and_off(fused_off)


@pytest.mark.parametrize("T", [1, 3, 9, 16, 32])
@pytest.mark.parametrize("shared", ["none", "gated", "ungated"])
@pytest.mark.parametrize("D, F_, layout", [(64, 48, "mixed"), (96, 160, "row"), (40, 24, "input")])
def test_moe_decode_equals_the_torch_block(T, shared, D, F_, layout):
    """T tokens through MoEBlock.forward, fused vs its torch path: output and the routing recorded."""
    from engine.models.layout import input_major, preferred_layout
    from engine.models.moe import MoEBlock, RoutingRecord

    g = torch.Generator().manual_seed(D + F_)
    block = MoEBlock(D, 8, 3, F_, True, 0 if shared == "none" else 56, shared_gated=shared == "gated").eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            lay = {"mixed": preferred_layout, "input": input_major, "row": lambda w: w.contiguous()}[layout]
            p.data = lay(p.data)
    x = torch.randn(T, D, generator=g)
    with torch.inference_mode():
        rec = RoutingRecord()
        out, _ = block.forward(x, record=rec, fused=True)
        with fused_off():
            assert not block._fused_cpu(x, x)
            ref_rec = RoutingRecord()
            ref, _ = block.forward(x, record=ref_rec, fused=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(rec.expert_ids[0], ref_rec.expert_ids[0])
    block.expert_fn = block.local_experts  # EP / offload replace the local compute: the torch path
    with torch.inference_mode():
        assert not block._fused_cpu(x, x)


def test_moe_decode_skips_non_local_experts_like_the_reference():
    """expert id -1 contributes 0 (kernels.fused_moe_ref's convention)."""
    import kernels

    g = torch.Generator().manual_seed(3)
    T, D, E, F_, r = 5, 48, 6, 32, 3
    x, gu, down = (
        torch.randn(T, D, generator=g),
        torch.randn(E, 2 * F_, D, generator=g),
        torch.randn(E, D, F_, generator=g),
    )
    ids = torch.randint(0, E, (T, r), generator=g)
    ids[0, 1] = ids[3, 0] = -1
    w = torch.rand(T, r, generator=g)
    ref = kernels.fused_moe_ref(x, gu, down, ids, w)
    torch.testing.assert_close(cpu_decode.moe_decode(x, gu, down, ids, w), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T, E, r", [(1, 16, 2), (5, 64, 8), (32, 8, 2), (3, 60, 4), (2, 4, 4)])
@pytest.mark.parametrize("norm", [False, True])
def test_route_softmax_equals_the_torch_ops(T, E, r, norm):
    g = torch.Generator().manual_seed(T * 100 + E + r)
    logits = torch.randn(T, E + 9, generator=g)[:, :E]  # a slice of the fused input projection: strided rows
    logits[0, 1] = logits[0, 0]  # a tie: the lower expert id first
    w, ids = cpu_decode.route_softmax(logits, r, norm)
    probs = torch.softmax(logits, dim=-1)
    ref_w = probs.gather(1, ids)
    if norm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    assert ids.dtype == torch.long and w.dtype == torch.float32
    order = logits.gather(1, ids)
    assert bool((order[:, :-1] >= order[:, 1:]).all())  # descending
    assert torch.equal(order, logits.topk(r, dim=-1).values)  # the r largest
    tied = ids[0].tolist()
    if 0 in tied and 1 in tied:
        assert tied.index(0) < tied.index(1)


def test_block_routing_with_and_without_the_fused_call():
    from engine.models.moe import MoEBlock

    block = MoEBlock(32, 12, 3, 16, True).eval()
    x = torch.randn(7, 32)
    with torch.inference_mode():
        got = block.route(x)
        with fused_off():
            ref = block.route(x)
    assert torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("T", [1, 3, 16, 32])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_packed_weights(T, shared, monkeypatch):
    """moe_decode from the strip-packed copies: the in-place sweep's bits for input-major weights, and the row-major
    weights' dot products to ~1e-6 (a different summation order)."""
    monkeypatch.setitem(small_m._packs, "on", True)  # whatever the build's default
    g = torch.Generator().manual_seed(T + 100 * shared)
    E, D, F_, Fs, r = 6, 40, 24, 20, 2
    gu, dn = torch.randn(E, 2 * F_, D, generator=g), torch.randn(E, D, F_, generator=g)
    x, w = torch.randn(T, D, generator=g), torch.rand(T, r, generator=g)
    ids = torch.randint(0, E, (T, r), generator=g)
    ids[0, 0] = -1
    sh = (torch.randn(T, 2 * Fs + 1, generator=g), torch.randn(D, Fs, generator=g), True) if shared else ()
    for layout in (input_major, lambda t: t.contiguous()):
        args = (x, layout(gu), layout(dn), ids, w) + ((sh[0], layout(sh[1]), True) if shared else ())
        plain, packed = cpu_decode.moe_decode(*args), cpu_decode.moe_decode(*args, pack=True)
        assert small_m.packed(args[1]) is not None
        if layout is input_major:
            assert torch.equal(packed, plain)
        else:
            torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))
