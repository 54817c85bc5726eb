"""engine.zoo.realism: top-token probability, entropy and 4-gram repeats on a target's greedy path."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.checkpoint import init_weights
from engine.models.config import parse_config
from engine.models.transformer import Model
from engine.zoo.head_objectives import SMOKE_TARGET
from engine.zoo.realism import distribution_sums, greedy_path_figures, repeated_ngrams


def test_repeated_ngrams_known_answers():
    loop = [1, 2, 3, 4, 1, 2, 3, 4]
    assert repeated_ngrams(loop, start=4) == (1, 1)  # (1 2 3 4) again, first seen in the prompt
    assert repeated_ngrams(loop, start=0) == (1, 5)
    assert repeated_ngrams([1, 2, 3, 4, 5, 6, 7], start=2) == (0, 2)  # fresh text
    assert repeated_ngrams([7, 7, 7, 7, 7, 7], start=0) == (2, 3)  # every gram after the first repeats
    assert repeated_ngrams([1, 2, 3], start=0) == (0, 0)  # shorter than a gram


def test_distribution_sums_known_answers():
    V = 8
    top, ent = distribution_sums(torch.zeros(3, V))  # uniform
    assert top == pytest.approx(3 / V) and ent == pytest.approx(3 * math.log(V))
    sure = torch.full((2, V), float("-inf"))
    sure[:, 3] = 0.0  # masked logits: exactly one token possible
    assert distribution_sums(sure) == pytest.approx((2.0, 0.0))
    two = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert distribution_sums(two) == pytest.approx((0.5, math.log(2)))


def test_greedy_path_figures_score_the_generated_tokens():
    """Every generated token is the argmax of its row, so top_prob is the mean probability of what was emitted."""
    torch.manual_seed(0)
    target = init_weights(Model(parse_config(SMOKE_TARGET)), 0, std=0.3).eval().requires_grad_(False)
    prompts = [[5, 6, 7, 8], [9, 10]]
    figures = greedy_path_figures(target, prompts, new_tokens=12)
    assert figures.positions == 24 and figures.ngrams == 2 * 9
    from engine.runtime.engine import Engine

    want_top, want_ent = 0.0, 0.0
    for prompt, res in zip(prompts, Engine(target, timing=False).generate(prompts, 12)):
        seq = prompt + res.token_ids
        probs = torch.softmax(target.logits(torch.tensor([seq[:-1]]))[0, len(prompt) - 1 :], -1)
        assert probs.argmax(-1).tolist() == res.token_ids
        want_top += float(probs.max(-1).values.sum())
        want_ent += float(-(probs * probs.log()).sum())
    assert figures.top_prob == pytest.approx(want_top / 24, rel=1e-5)
    assert figures.entropy == pytest.approx(want_ent / 24, rel=1e-5)
    assert 0.0 <= figures.repeat4 <= 1.0


def test_realism_report_entry_point(tmp_path):
    """`python -m engine.zoo.realism_report` at the smallest budget: JSON, and the table merged into a zoo folder."""
    import json
    import os
    import subprocess
    import sys

    from engine.paths import REPO_ROOT, zoo_path

    env = {**os.environ, "EXPERTSPEC_ZOO": str(tmp_path / "zoo")}
    cmd = [sys.executable, "-m", "engine.zoo.realism_report", f"targets=[{zoo_path('tiny-moe')}]", "workloads=[code]",
           "prompts=1", "new_tokens=8", "zoo_entry=probe", "note=probe note", f"out={tmp_path / 'r.json'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert set(rep["figures"]["tiny-moe"]["code"]) >= {"top_prob", "entropy", "repeat4"}
    assert rep["ngram_tau"]["tiny-moe"]["code"] >= 1.0
    assert "probe note" in (tmp_path / "zoo" / "README.md").read_text()
    assert "probe" in json.loads((tmp_path / "zoo" / "manifest.json").read_text())
    bad = subprocess.run([*cmd[:3], "workloads=[poetry]"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "unknown workloads" in bad.stderr
