"""Expert offload: bit-identical outputs, LRU/LFU known answers, bytes, prefetch accounting, timing model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_configs import tiny_config

import engine
from engine.cost.roofline import load_hardware
from engine.models.checkpoint import build_model
from engine.offload.cache import ExpertOffload, OffloadStats, next_router_predictor, transfer_seconds

PROMPTS = [[5, 7, 9, 11, 3], [1, 2], [60, 61, 62]]


def _sharp(model_type: str, **over) -> engine.Model:
    """A tiny random MoE target with sharp logits (as tests/conftest.py scales its checkpoint)."""
    model = build_model(tiny_config(model_type, **over), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def target() -> engine.Model:
    return _sharp("qwen2_moe")  # 6 experts, top-2, shared expert, 2 MoE layers


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", ["simulate", "copy"])
@pytest.mark.parametrize(("model_type", "over"), [("qwen2_moe", {}), ("qwen3_moe", dict(num_experts_per_tok=3))])
def test_offloaded_outputs_identical_to_plain_model(mode, model_type, over):
    model = _sharp(model_type, **over)
    ids = torch.randint(0, model.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    ref_logits = model.logits(ids)
    ref = engine.Engine(model).generate(PROMPTS, 16)
    for C in (1, 4):
        with ExpertOffload(model, C, mode=mode) as off:
            logits = model.logits(ids)
            out = engine.Engine(model).generate(PROMPTS, 16)
            assert off.stats.misses > 0
        if mode == "simulate" or model.config.top_r <= 2:  # copy with r > 2 sums slots in another order
            assert torch.equal(logits, ref_logits)
        else:
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert all(b.expert_fn is None for b in model.moe_blocks)  # removed on exit


def test_seeded_sampling_identical_with_offload(target):
    params = engine.SamplingParams(temperature=0.8, top_k=20, seed=3)
    ref = engine.Engine(target).generate(PROMPTS, 12, sampling=params)
    with ExpertOffload(target, 2):
        out = engine.Engine(target).generate(PROMPTS, 12, sampling=params)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]


# ---------------------------------------------------------------------------------------- eviction
SEQUENCE = [0, 1, 0, 2, 1, 0, 3, 0]


@pytest.mark.parametrize(
    ("policy", "hits", "evicted", "final"),
    [
        # LRU: 0m 1m 0h 2m(-1) 1m(-0) 0m(-2) 3m(-1) 0h
        ("lru", [0, 0, 1, 0, 0, 0, 0, 1], [[], [], [], [1], [0], [2], [1], []], [0, 3]),
        # LFU (counts kept across evictions, ties LRU): 0m 1m 0h(f0=2) 2m(-1) 1m(-2) 0h 3m(-1: f1=2<f0=3) 0h
        ("lfu", [0, 0, 1, 0, 0, 1, 0, 1], [[], [], [], [1], [2], [], [1], []], [0, 3]),
    ],
)
def test_eviction_known_answer(target, policy, hits, evicted, final):
    off = ExpertOffload(target, 2, policy=policy)
    got_hits, got_evicted = [], []
    for e in SEQUENCE:
        res = off.access(0, [e])
        got_hits.append(len(res.hits))
        got_evicted.append(res.evicted)
        assert len(res.hits) + len(res.misses) == 1 and not res.streamed
    assert got_hits == hits and got_evicted == evicted
    assert off.cached_experts(0) == final and off.cached_experts(1) == []
    st = off.stats
    assert (st.hits, st.misses, st.evictions) == (sum(hits), len(hits) - sum(hits), sum(map(len, evicted)))
    assert st.hit_rate == sum(hits) / len(hits)
    assert st.bytes_moved == st.misses * off.expert_bytes


def test_access_dedups_protects_and_streams(target):
    off = ExpertOffload(target, 2)
    res = off.access(0, [2, 0, 2, -1, 1])  # needs {0, 1, 2}: two cached, the third streamed
    assert (res.hits, res.misses, res.evicted, res.streamed) == ([], [0, 1, 2], [], [2])
    assert off.cached_experts(0) == [0, 1]
    res = off.access(0, [1, 3])  # 0 is the only unneeded cached expert: evicted
    assert (res.hits, res.misses, res.evicted, res.streamed) == ([1], [3], [0], [])
    assert off.stats.bytes_moved == 4 * off.expert_bytes and off.stats.streamed == 1


def test_bytes_moved_equals_misses_times_expert_bytes(target):
    cfg = target.config
    with ExpertOffload(target, 3) as off:
        engine.Engine(target).generate(PROMPTS, 10)
        st = off.stats
    assert off.expert_bytes == 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert st.misses > 0 and st.bytes_moved == st.misses * off.expert_bytes
    assert sum(st.misses_by_layer) == st.misses and st.prefetch_loads == 0
    assert st.transfer_seconds == pytest.approx(st.misses * transfer_seconds(off.expert_bytes, off.hardware))
    assert st.exposed_seconds == pytest.approx(st.transfer_seconds)  # no prefetch: every load is exposed
    assert st.layer_forwards > 0 and st.compute_seconds > 0


# ---------------------------------------------------------------------------------------- prefetch
def test_prefetch_accuracy_and_wasted_bytes(target):
    off = ExpertOffload(target, 2)
    off.access(0, [0])
    off.access(0, [1])
    assert off.prefetch(0, [2, 3, 2, 5]) == [2, 3]  # first C distinct ids; 0 and 1 evicted
    assert off.prefetch(0, [3]) == []  # already cached: no load
    st = off.stats
    assert (st.prefetch_loads, st.prefetch_pending, st.evictions) == (2, 2, 2)
    off.access(0, [2])  # used before eviction
    off.access(0, [4])  # evicts 3 (least recent), never used
    assert (st.prefetch_used, st.prefetch_wasted, st.prefetch_pending) == (1, 1, 0)
    assert st.prefetch_accuracy == 0.5
    assert st.wasted_prefetch_bytes == off.expert_bytes
    assert st.prefetch_bytes == 2 * off.expert_bytes
    assert st.bytes_moved == (3 + 2) * off.expert_bytes  # 3 demand misses + 2 prefetches
    assert (st.hits, st.misses) == (1, 3)


def test_predictor_prefetch_keeps_outputs_and_balances(target):
    ref = engine.Engine(target).generate(PROMPTS, 12)
    with ExpertOffload(target, 3, predictor=next_router_predictor(target)) as off:
        out = engine.Engine(target).generate(PROMPTS, 12)
        st = off.stats
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert st.prefetch_loads > 0 and st.prefetch_used > 0
    assert st.prefetch_used + st.prefetch_wasted + st.prefetch_pending == st.prefetch_loads
    assert 0.0 <= st.prefetch_accuracy <= 1.0
    assert st.bytes_moved == (st.misses + st.prefetch_loads) * off.expert_bytes


# ---------------------------------------------------------------------------------------- timing
def test_transfer_and_exposed_time_known_answer(target):
    hw = dataclasses.replace(load_hardware("h100"), pcie_bandwidth=1e9, pcie_latency=1e-3)
    clock = FakeClock()
    off = ExpertOffload(target, 4, hardware=hw, clock=clock)
    tt = off.expert_bytes / 1e9 + 1e-3
    assert transfer_seconds(off.expert_bytes, hw) == pytest.approx(tt)

    off.access(0, [0, 1])  # demand misses: exposed in full
    assert off.stats.exposed_seconds == pytest.approx(2 * tt)
    assert off.stats.exposed_by_layer == pytest.approx([2 * tt, 0.0])

    off.stats.reset()
    clock.t = 10.0
    off.prefetch(1, [0, 1])  # issued at t = 10 (+ stalls so far), lands 2 tt later
    clock.t += tt  # half the transfer hidden behind compute: exposed = 2 tt - tt
    off.access(1, [0, 1])
    assert off.stats.exposed_seconds == pytest.approx(tt)
    assert off.stats.transfer_seconds == pytest.approx(2 * tt)

    off.stats.reset()
    off.prefetch(1, [2])
    clock.t += 5 * tt  # fully hidden
    off.access(1, [2])
    assert off.stats.exposed_seconds == 0.0 and off.stats.prefetch_used == 1

    off.stats.reset()
    off.prefetch(0, [2])  # queued behind nothing; a demand miss in the same layer adds its full transfer
    off.access(0, [2, 3])
    assert off.stats.exposed_seconds == pytest.approx(tt + tt)


def test_no_gpu_note_and_stats_snapshot_reset(target):
    off = ExpertOffload(target, 2, hardware="h100")
    if not torch.cuda.is_available():
        assert not off.stats.gpu
        assert off.stats.timing_note == "timed with h100 PCIe bandwidth (64 GB/s), no GPU present"
    off.access(0, [0, 1])
    off.prefetch(1, [4])
    snap = off.stats.snapshot()
    off.stats.reset()
    assert (snap.misses, snap.prefetch_pending, snap.misses_by_layer) == (2, 1, [2, 0])
    assert isinstance(snap, OffloadStats) and snap.hit_rate == 0.0
    st = off.stats
    assert (st.misses, st.bytes_moved, st.misses_by_layer, st.exposed_by_layer) == (0, 0, [0, 0], [0.0, 0.0])
    assert st.prefetch_pending == 1 and st.timing_note == snap.timing_note  # gauges survive reset
    assert st.hit_rate is None and st.prefetch_accuracy is None


# ---------------------------------------------------------------------------------------- API edges
def test_validation_and_install(target):
    with pytest.raises(ValueError, match="cache_experts_per_layer"):
        ExpertOffload(target, 0)
    with pytest.raises(ValueError, match="cache_experts_per_layer"):
        ExpertOffload(target, 7)
    with pytest.raises(ValueError, match="policy"):
        ExpertOffload(target, 2, policy="fifo")
    with pytest.raises(ValueError, match="mode"):
        ExpertOffload(target, 2, mode="teleport")
    dense = build_model(tiny_config("llama"), seed=0)
    with pytest.raises(ValueError, match="no MoE layer"):
        ExpertOffload(dense, 1)
    with ExpertOffload(target, 2) as off:
        with pytest.raises(ValueError, match="already installed"):
            off.install()
        with pytest.raises(ValueError, match="already has an expert_fn"):
            ExpertOffload(target, 2).install()
        off.warm()
        assert off.cached_experts(0) == [0, 1] and off.stats.misses == 0
        x = torch.randn(3, target.config.hidden_size)
        with pytest.raises(ValueError, match="not cached"):
            off.compute_cached(0, x, torch.tensor([[0, 2]] * 3), torch.ones(3, 2))
        out = off.compute_cached(0, x, torch.tensor([[0, 1], [1, -1], [-1, -1]]), torch.ones(3, 2))
        assert out.shape == x.shape and torch.equal(out[2], torch.zeros_like(out[2]))
        assert off.stats.hits == off.stats.misses == 0  # compute_cached changes nothing


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_mode_moves_weights_and_matches():
    model = _sharp("qwen2_moe").cuda()
    ids = torch.randint(0, model.vocab_size, (3, 9), device="cuda")
    ref_logits = model.logits(ids)
    ref = engine.Engine(model).generate(PROMPTS, 16)
    with ExpertOffload(model, 2, predictor=next_router_predictor(model)) as off:
        assert off.mode == "copy" and off.stats.gpu
        for block in model.moe_blocks:  # the only copy of the experts is in pinned host memory
            assert block.experts.gate_up_proj.device.type == "cpu" and block.experts.gate_up_proj.is_pinned()
        logits = model.logits(ids)
        out = engine.Engine(model).generate(PROMPTS, 16)
        st = off.stats
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, ref_logits), "Triton sums each token's slots in order: remapping should be exact"
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert st.bytes_moved == (st.misses + st.prefetch_loads) * off.expert_bytes
    assert all(b.experts.gate_up_proj.device.type == "cuda" for b in model.moe_blocks)  # restored


# ---------------------------------------------------------------------------------------- engine hook
def test_engine_attaches_offload_stats_per_round(target):
    with ExpertOffload(target, 2) as off:
        eng = engine.Engine(target, offload=off)
        res = eng.generate(PROMPTS, 8)
        total = off.stats.misses  # after the last step's snapshot: nothing left
    rounds = [r for res_i in res for r in res_i.rounds]
    assert all(isinstance(r.offload, OffloadStats) for r in rounds) and total == 0
    steps = {id(r.offload): r.offload for r in rounds}.values()  # one record per batched step
    assert len(steps) == 8 and sum(s.misses for s in steps) > 0
    assert all(s.bytes_moved == s.misses * off.expert_bytes for s in steps)
    assert "no GPU present" in rounds[0].offload.timing_note or rounds[0].offload.gpu
