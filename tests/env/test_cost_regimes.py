"""The offloaded and the EP cost regimes (env.cost_offload, env.cost_ep) on hand-made routings, against the
engine's own offload cache and EP roofline, and in the replay environment."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import SMALL_GRID  # noqa: E402  (tests/env is on sys.path while pytest runs its conftest)

from engine.cost.roofline import RooflineCost, load_hardware, load_model_spec
from engine.offload.cache import ExpertOffload
from engine.parallel.placement import place_experts
from env.cost_ep import EPCostModel
from env.cost_offload import ExpertCacheState, OffloadCostModel, cache_slots
from env.costs import CostConf, RooflineCostModel, make_cost_model


def _offload(fraction: float = 0.25, policy: str = "lru") -> OffloadCostModel:
    return OffloadCostModel("h200", load_model_spec("qwen3_30b_a3b"), "qwen3_30b_a3b_eagle3", fraction, policy)


def _mask(L: int, E: int, per_layer: dict[int, list[int]]) -> np.ndarray:
    m = np.zeros((L, E), dtype=bool)
    for layer, experts in per_layer.items():
        m[layer, experts] = True
    return m


# ---------------------------------------------------------------------------------------------- offload
def test_a_hit_is_free_and_a_miss_costs_its_bytes_over_pcie():
    model = _offload()
    hw, spec = load_hardware("h200"), load_model_spec("qwen3_30b_a3b")
    assert model.capacity == 32  # 25 % of 128 experts per layer
    assert model.miss_seconds == pytest.approx(spec.expert_bytes / hw.pcie_bandwidth + hw.pcie_latency, rel=1e-12)
    state = model.new_state()
    L, E, _ = model.routing_shape
    needed = _mask(L, E, {0: [3, 7, 9], 5: [1]})
    assert state.peek(needed) == 4 and state.rounds == 0  # peek changes nothing
    misses = state.access(needed)
    assert misses[0] == 3 and misses[5] == 1 and misses.sum() == 4
    per_expert = spec.expert_bytes / hw.pcie_bandwidth + hw.pcie_latency
    assert model.transfer(int(misses.sum())) == pytest.approx(4 * per_expert)
    assert state.access(needed).sum() == 0 and model.transfer(0) == 0.0  # every pair cached: no bytes move
    assert state.access(_mask(L, E, {0: [3, 8]})).tolist()[0] == 1  # only the new expert misses


def test_lru_evicts_the_least_recently_used_and_lfu_the_least_frequent():
    lru = ExpertCacheState(1, 6, 3, "lru")
    for experts in ([0], [1], [2], [0], [3]):  # the cache is full after [2]; [3] evicts 1, used least recently
        lru.access(_mask(1, 6, {0: experts}))
    assert lru.cached_experts(0) == [0, 2, 3]
    lru.access(_mask(1, 6, {0: [1]}))  # now 2 is the least recent
    assert lru.cached_experts(0) == [0, 1, 3]
    seq = ([0], [0], [0], [1], [2], [3])  # [3] evicts: LRU the least recent (0), LFU the least frequent (1 ties 2)
    for policy, kept in (("lru", [1, 2, 3]), ("lfu", [0, 2, 3])):
        state = ExpertCacheState(1, 6, 3, policy)
        for experts in seq:
            state.access(_mask(1, 6, {0: experts}))
        assert state.cached_experts(0) == kept, policy
    full = ExpertCacheState(1, 6, 2, "lru")  # more needed experts than slots: the extra miss is streamed
    assert full.access(_mask(1, 6, {0: [0, 1, 2]})).tolist() == [3] and full.cached_experts(0) == [0, 1]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_state_equals_the_engine_offload_cache(policy):
    """The numpy twin against engine.offload.cache.ExpertOffload.access (simulate mode, no model needed)."""
    L, E, C = 3, 12, 4
    blocks = [SimpleNamespace(num_experts=E, experts=SimpleNamespace(gate_up_proj=torch.zeros(E, 8, 4)))] * L
    fake = SimpleNamespace(moe_blocks=blocks, device=torch.device("cpu"))
    ref = ExpertOffload(fake, C, policy=policy, mode="simulate", hardware="h200")
    ours = ExpertCacheState(L, E, C, policy)
    rng = np.random.default_rng(0)
    for _ in range(200):
        needed = rng.random((L, E)) < rng.choice([0.1, 0.3, 0.6])  # sometimes more than C: streamed misses
        misses = ours.access(needed)
        for layer in range(L):
            got = ref.access(layer, np.flatnonzero(needed[layer]).tolist())
            assert len(got.misses) == misses[layer]
            assert ref.cached_experts(layer) == ours.cached_experts(layer)


def test_cache_slots_and_bad_offload_options():
    assert cache_slots(0.25, 128) == 32 and cache_slots(0.001, 16) == 1 and cache_slots(1.0, 16) == 16
    with pytest.raises(ValueError, match="fraction"):
        cache_slots(0.0, 16)
    with pytest.raises(ValueError, match="offload_policy"):
        _offload(policy="fifo")
    m = make_cost_model(CostConf(kind="roofline-offload", hardware="h200", offload_cache=0.5, offload_policy="lfu"), {})
    assert isinstance(m, OffloadCostModel) and m.stateful and m.capacity == 64 and m.policy == "lfu"


# ---------------------------------------------------------------------------------------------- EP
def _uniform(n: int, L: int, E: int, r: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.rand(n, E, generator=g).topk(r, -1).indices for _ in range(L)], 1).numpy()  # [n, L, r]


@pytest.mark.parametrize(
    ("spec_name", "hardware", "ranks", "placement"),
    [
        ("qwen3_30b_a3b", "h200", 8, "contiguous"),
        ("qwen3_30b_a3b", "h200", 8, "round_robin"),
        ("deepseek_v3", "h100", 8, "contiguous"),  # dense first layers, a shared expert on rank 0
        ("qwen3_30b_a3b", "h200", 16, "contiguous"),  # two nodes: inter-node all-to-all
    ],
)
def test_ep_cost_equals_the_engine_roofline_ep(spec_name, hardware, ranks, placement):
    spec, hw = load_model_spec(spec_name), load_hardware(hardware)
    ours = EPCostModel(hardware, spec, f"{spec_name}_eagle3", ranks, placement)
    layout = place_experts(spec.num_experts, ranks, placement, ranks_per_node=hw.gpus_per_node)
    ref = RooflineCost(hw, spec, layout=layout)
    for n in (1, 2, 9, 40):
        ids = _uniform(n, spec.num_moe_layers, spec.num_experts, spec.top_r, n)
        routing = [torch.from_numpy(ids[:, layer]) for layer in range(spec.num_moe_layers)]
        assert ours.verify(n, 0, 300, routing=ids) == pytest.approx(ref.forward_cost(routing, 300).total, rel=1e-9)
    assert ours.ar(300, ids[:1]) == ours.verify(1, 0, 300, routing=ids[:1])


def test_ep_cost_is_the_slowest_rank_plus_the_all_to_alls():
    spec, hw = load_model_spec("qwen3_30b_a3b"), load_hardware("h200")
    ep = EPCostModel("h200", spec, "qwen3_30b_a3b_eagle3")  # contiguous: rank w holds experts 16w .. 16w + 15
    resident = RooflineCostModel("h200", spec, "qwen3_30b_a3b_eagle3")
    L, r = spec.num_moe_layers, spec.top_r
    base = resident.verify(1, 0, 100)  # everything but the routed experts
    mem = spec.expert_bytes / hw.hbm_bandwidth
    msg = spec.hidden_size * spec.activation_bytes
    bw, lat = hw.nvlink_bandwidth, hw.nvlink_latency
    on_rank3 = np.broadcast_to(np.arange(48, 48 + r), (1, L, r))  # all 8 experts on rank 3: one remote rank
    expect = base + L * (r * mem + 2 * (msg / bw + lat))
    assert ep.verify(1, 0, 100, routing=on_rank3) == pytest.approx(expect, rel=1e-12)
    spread = np.broadcast_to(np.arange(r) * 16, (1, L, r))  # one expert per rank: 7 remote ranks, 1 expert each
    expect = base + L * (mem + 2 * (7 * msg / bw + lat))
    assert ep.verify(1, 0, 100, routing=spread) == pytest.approx(expect, rel=1e-12)
    local = np.broadcast_to(np.arange(r), (1, L, r))  # every expert on rank 0, where the token lives: no traffic
    assert ep.verify(1, 0, 100, routing=local) == pytest.approx(base + L * r * mem, rel=1e-12)
    assert ep.verify(1, 0, 100, routing=local) == pytest.approx(resident.verify(1, L * r, 100), rel=1e-12)
    with pytest.raises(ValueError, match="routing"):
        ep.verify(1, L * r, 100)
    with pytest.raises(ValueError, match="ep_placement"):
        EPCostModel("h200", spec, "qwen3_30b_a3b_eagle3", 8, "replicated")
    m = make_cost_model(CostConf(kind="roofline-ep", hardware="h200", ep_ranks=4), {})
    assert isinstance(m, EPCostModel) and m.needs_routing and m.placement.world_size == 4


def test_live_env_refuses_replay_only_kinds():
    from env.live import LiveEnv

    for kind in ("roofline-offload", "roofline-ep"):
        with pytest.raises(ValueError, match="replay only"):
            LiveEnv(cost={"kind": kind})


# ---------------------------------------------------------------------------------------------- replay
def _episode(e, request: int, actions: list) -> list[tuple[float, float, float]]:
    e.reset(options={"request": request})
    out, i, done = [], 0, False
    while not done:
        _, _, term, trunc, info = e.step(actions[i % len(actions)])
        out.append((info["cost"], info["cost_verify"], info["cost_ar"]))
        i, done = i + 1, term or trunc
    return out


@pytest.mark.parametrize("model_spec", ["target", "qwen3_30b_a3b"])
def test_offload_replay_is_deterministic_and_plain_decoding_pays_exactly_t_ar(greedy_trace, model_spec):

    from env.oracle import static_returns
    from env.replay import ReplayEnv

    cost = {"kind": "roofline-offload", "model_spec": model_spec, "hardware": "h200"}
    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=cost, cache=False)
    e.action_space.seed(0)
    actions = [e.action_space.sample() for _ in range(16)]
    first = _episode(e, 0, actions)
    _episode(e, 1, actions[::-1])  # another request in between: its cache must not leak into the next episode
    assert _episode(e, 0, actions) == first  # same actions, same costs after every reset
    resident = _episode(ReplayEnv(greedy_trace, grid=SMALL_GRID, cost={**cost, "kind": "roofline"}, cache=False),
                        0, actions)  # fmt: skip
    assert len(resident) == len(first) and all(c >= r for (c, _, _), (r, _, _) in zip(first, resident))
    assert first[0][0] - resident[0][0] > 0  # the first round loads every expert it touches over PCIe
    plain = _episode(e, 0, [e.codec.encode((0, 0, 0, 0))])  # target-only: its cache is plain decoding's own
    assert all(c == ar for c, _, ar in plain) and len(plain) == len(e.trace.positions_of(0))
    assert plain[0][2] > plain[-1][2]  # the first step fills an empty cache
    _, total = static_returns(e, 0)  # simulated per action with its own cache, priced as the env prices it
    for a in (0, 7, total.shape[0] - 1):
        idx = e.codec.unflat(a)
        assert sum(c for c, _, _ in _episode(e, 0, [e.codec.encode(idx)])) == pytest.approx(total[a], rel=1e-12)


def test_ep_replay_prices_the_recorded_routing(greedy_trace):

    from env.replay import ReplayEnv

    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost={"kind": "roofline-ep", "model_spec": "target",
                                                       "hardware": "h200", "ep_ranks": 4}, cache=False)  # fmt: skip
    assert e.routing == "recorded" and e.cost_model.placement.world_size == 4
    p = e.trace.positions_of(0).start
    root = e.trace.node_routing[e.trace.nodes_of(p)][:1]  # [1, L, r]
    assert e.tables.ar[p] == e.cost_model.verify(1, 0, int(e.tables.context[p]), routing=root)
    plain = _episode(e, 0, [e.codec.encode((0, 0, 0, 0))])
    assert all(c == ar for c, _, ar in plain)
    spec = _episode(e, 0, [e.codec.encode((3, 1, 0, 0))])
    assert len(spec) < len(plain) and all(np.isfinite(c) and c > 0 for c, _, _ in spec)
