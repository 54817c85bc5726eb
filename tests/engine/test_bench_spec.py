"""`python -m engine.bench spec` pieces: the sweep grid, the "best exact" chooser, clear errors.
(The whole entry point at the smallest budget is tests/test_entry_points.py::test_bench_spec_smoke.)"""

from __future__ import annotations

import pytest

from engine.bench.configs import BenchConfig
from engine.bench.spec import bench_spec, best_exact, spec_grid


def _row(drafter: str, K: int, speedup: float, exact: bool = True) -> dict:
    return {"drafter": drafter, "K": K, "W": 1, "speedup": speedup, "exact": exact}


def test_best_exact_never_picks_plain_decoding():
    rows = [_row("dense", 0, 1.05), _row("ngram", 0, 1.10), _row("dense", 2, 0.80), _row("ngram", 3, 0.95)]
    assert best_exact(rows) == rows[3]  # K = 0 is faster here, but it is not speculation
    assert best_exact(rows, "dense") == rows[2]


def test_best_exact_skips_inexact_rows_and_may_find_none():
    rows = [_row("dense", 2, 3.0, exact=False), _row("dense", 1, 1.2), _row("ngram", 0, 1.5)]
    assert best_exact(rows) == rows[1]
    assert best_exact(rows, "ngram") is None
    assert best_exact([_row("dense", 0, 1.0)]) is None


def test_spec_grid():
    cfg = BenchConfig(depths=[0, 2], widths=[1, 2, 3])
    grid = spec_grid(cfg, ["dense", "ngram"])
    assert grid == [("dense", 0, 1), ("dense", 2, 1), ("dense", 2, 2), ("dense", 2, 3),
                    ("ngram", 0, 1), ("ngram", 2, 1), ("ngram", 2, 2)]  # fmt: skip


def test_checkpoint_without_tokenizer_is_a_clear_error(tiny_moe_dir, tiny_dense_dir):
    cfg = BenchConfig(mode="spec", target=str(tiny_moe_dir), drafter=str(tiny_dense_dir), hf=False)
    with pytest.raises(ValueError, match="has no tokenizer.json.*target=<a checkpoint folder with tokenizer.json>"):
        bench_spec(cfg)


def test_unknown_spec_drafter_is_a_clear_error_before_loading():
    cfg = BenchConfig(mode="spec", target="/nonexistent", spec_drafters=["ngram", "medusa"])
    with pytest.raises(ValueError, match=r"spec_drafters=\['ngram', 'medusa'\]: choose one or more of"):
        bench_spec(cfg)  # before the (missing) target is read
    with pytest.raises(ValueError, match="choose one or more"):
        bench_spec(BenchConfig(mode="spec", spec_drafters=[]))


def test_spec_bench_sweeps_only_the_chosen_drafters():
    """spec_drafters=[ngram]: only the n-gram rows, no transformers assisted run (it needs the dense drafter)."""
    from engine.zoo.build import zoo_path

    try:
        zoo_path("tiny-moe")
    except FileNotFoundError:
        pytest.skip("the zoo is not shipped in this checkout")
    cfg = BenchConfig(mode="spec", spec_drafters=["ngram"], new_tokens=6, repeats=1, num_prompts=1, depths=[0, 2],
                      widths=[1, 2], lams=[0.0])  # fmt: skip
    res = bench_spec(cfg)
    for wl in ("code", "prose"):
        assert {r["drafter"] for r in res[wl]["rows"]} == {"ngram"} and all(r["exact"] for r in res[wl]["rows"])
        assert "assisted" not in res[wl] and "lambda_sweep" not in res[wl]
