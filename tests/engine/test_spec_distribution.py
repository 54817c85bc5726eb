"""The whole engine samples the exact target law under speculation (chi-square vs enumeration).

A tiny-vocabulary random MoE target and a random dense drafter; the joint law of the first three
generated tokens (V^3 cells) is computed exactly by enumerating prefixes through the target.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hf_configs import tiny_config
from scipy import stats

import engine
from engine.models.checkpoint import build_model
from engine.spec.sampling import SamplingParams, process_logits

V = 8
PROMPT = [1, 5, 2]
N = 20_000


@pytest.fixture(scope="module")
def pair():
    target = build_model(tiny_config("qwen2_moe", vocab_size=V), seed=11)
    drafter = build_model(tiny_config("llama", vocab_size=V), seed=12)
    with torch.no_grad():  # scale logits: a rich target law (hundreds of cells) and a drafter that differs
        for m, scale in ((target, 5.0), (drafter, 4.0)):
            m.lm_head.weight.mul_(scale)
    return target.eval(), drafter.eval()


def exact_law(target, params: SamplingParams) -> torch.Tensor:
    """[V, V, V] probability of the first three generated tokens."""
    law = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = process_logits(target.logits(torch.tensor([PROMPT]))[0, -1], params).double()
    seqs2 = torch.tensor([PROMPT + [a] for a in range(V)])
    p2 = process_logits(target.logits(seqs2)[:, -1], params).double()  # [V, V]
    seqs3 = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(V), range(V))])
    p3 = process_logits(target.logits(seqs3)[:, -1], params).double().view(V, V, V)
    law = p1[:, None, None] * p2[:, :, None] * p3
    return law / law.sum()


def sample_engine(target, drafter, params, spec) -> torch.Tensor:
    eng = engine.Engine(target, drafter=drafter, instrument=False, timing=False)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    chunk = 2_000
    for start in range(0, N, chunk):
        sp = [
            SamplingParams(params.temperature, params.top_k, params.top_p, seed=params.seed + start + i)
            for i in range(chunk)
        ]
        for r in eng.generate([PROMPT] * chunk, 3, sampling=sp, spec=spec):
            a, b, c = r.token_ids
            counts[a, b, c] += 1
    eng.kv.check_quiescent()
    return counts


CASES = [
    ("chain-t1", SamplingParams(temperature=1.0, seed=1000), engine.SpecConfig(depth=3, width=1)),
    (
        "chain-t0.7-p0.9",
        SamplingParams(temperature=0.7, top_p=0.9, seed=2000),
        engine.SpecConfig(depth=2, width=1),
    ),
    ("tree-t1", SamplingParams(temperature=1.0, seed=3000), engine.SpecConfig(depth=2, width=2)),
    (
        "tree-drafted-t0.7-p0.9",
        SamplingParams(temperature=0.7, top_p=0.9, seed=4000),
        engine.SpecConfig(depth=2, width=2, drafted_children=True),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params", "spec"), CASES, ids=[c[0] for c in CASES])
def test_joint_law_of_first_three_tokens(pair, name, params, spec):
    target, drafter = pair
    law = exact_law(target, params).reshape(-1)
    counts = sample_engine(target, drafter, params, spec).reshape(-1)
    assert counts.sum() == N
    assert counts[law == 0].sum() == 0, "sampled a sequence the target law gives zero probability"
    expected = law * N
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    _, pvalue = stats.chisquare(obs[keep].numpy(), exp[keep].numpy())
    assert pvalue > 1e-6, f"{name}: chi-square p = {pvalue:.2e}"
