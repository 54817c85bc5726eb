"""The weight-read bound table of `python -m engine.bench` on tiny unseen shapes (no timing asserted)."""

from __future__ import annotations

import pytest

from engine.bench.bound import bench_bound, make_checkpoint
from engine.bench.configs import BoundShape

TINY = [
    BoundShape("q2", "qwen2_moe", 64, 2, 8, 2, 64, 2, 1, 512, 128),
    BoundShape("q3", "qwen3_moe", 64, 2, 8, 4, 32, 2, 1, 512),
]


def test_bound_rows_count_the_weights_each_forward_reads():
    res = bench_bound(TINY, [2, 4], new_tokens=4, repeats=1, hf=True)
    assert res["bandwidth"]["stream_Bps"] > 0 and res["bandwidth_after"]["gemm_flops"] > 0
    for shape in TINY:
        rows = res["shapes"][shape.name]["rows"]
        assert [r["tokens"] for r in rows] == [1, 2, 4]
        expert = 3 * shape.hidden_size * shape.moe_intermediate_size * 4
        # one decode token reads exactly top-r experts per layer; more tokens never read fewer
        assert rows[0]["mean_distinct_experts"] == shape.num_experts_per_tok
        assert rows[0]["weight_bytes"] < rows[1]["weight_bytes"] <= rows[2]["weight_bytes"]
        assert rows[2]["mean_distinct_experts"] <= shape.num_experts
        extra = rows[2]["weight_bytes"] - rows[0]["weight_bytes"]
        gained = (rows[2]["mean_distinct_experts"] - rows[0]["mean_distinct_experts"]) * shape.num_hidden_layers
        assert extra == pytest.approx(gained * expert)
        for r in rows:
            assert r["cache_resident"] == (r["weight_bytes"] <= res["bandwidth"]["llc_bytes"])
            assert r["bound_ratio"] == pytest.approx(r["seconds"] / r["bound_seconds"])
            assert r["roofline_ratio"] <= r["bound_ratio"] and r["speedup_vs_hf"] > 0


def test_stream_buffer_exceeds_the_last_level_cache(monkeypatch):
    import engine.bench.bound as bound

    monkeypatch.setattr(bound, "last_level_cache_bytes", lambda: 300 * 2**20)
    bw = bound.measure_bandwidth(repeats=1)
    assert bw["llc_bytes"] == 300 * 2**20 and bw["stream_buffer_bytes"] == 600 * 2**20  # DRAM's rate, not the cache's
    monkeypatch.setattr(bound, "last_level_cache_bytes", lambda: 0)  # unknown: the 512 MB default
    assert bound.measure_bandwidth(repeats=1)["stream_buffer_bytes"] == 512 * 2**20


def test_last_level_cache_size_reads_sysfs(tmp_path, monkeypatch):
    import engine.bench.bound as bound

    for i, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "480M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    real = bound.Path
    monkeypatch.setattr(bound, "Path", lambda p: tmp_path if "cpu0/cache" in str(p) else real(p))
    assert bound.last_level_cache_bytes() == 480 * 2**20


def test_checkpoint_loads_through_our_code_with_the_decode_layout(tmp_path):
    import engine
    from engine.models.layout import is_input_major

    shape = BoundShape("wide", "qwen3_moe", 64, 1, 4, 2, 128, 2, 1, 256)  # F = 128 > D = 64
    model = engine.load_model(make_checkpoint(shape, tmp_path))
    layer = model.model.layers[0]
    assert is_input_major(layer.self_attn.q_proj.weight)  # out >= in: stored [in, out]
    assert is_input_major(layer.mlp.experts.gate_up_proj)  # [E, 2F, D] stored [E, D, 2F]
    assert layer.mlp.experts.down_proj.is_contiguous()  # [E, D, F] with D < F: row-major reads faster
    assert not is_input_major(layer.mlp.experts.down_proj)
