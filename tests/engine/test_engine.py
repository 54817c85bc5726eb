"""Target-only decoding: parity with transformers generate, seeded sampling, batching, KV invariant."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency (pyproject [test]): a broken install fails, not skips

import engine
from engine.spec.sampling import SamplingParams

PROMPTS = [[5, 7, 9, 11, 3], [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [60]]


@pytest.fixture(scope="module")
def pair(tiny_moe_dir):
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_dir).float().eval()
    return ref, engine.load_model(tiny_moe_dir)


def _hf_greedy(ref, prompt, n):
    ids = torch.tensor([prompt])
    out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_batch1(pair):
    ref, ours = pair
    res = engine.Engine(ours).generate([PROMPTS[0]], 64)
    assert res[0].token_ids == _hf_greedy(ref, PROMPTS[0], 64)
    assert len(res[0].rounds) == 64 and all(r.committed == 1 for r in res[0].rounds)


def test_greedy_matches_transformers_mixed_batch(pair):
    ref, ours = pair
    res = engine.Engine(ours).generate(PROMPTS, 64)
    for prompt, r in zip(PROMPTS, res):
        assert r.token_ids == _hf_greedy(ref, prompt, 64)


def test_seeded_sampling_is_bit_identical_and_batch_independent(pair):
    _, ours = pair
    eng = engine.Engine(ours)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11 + i) for i in range(len(PROMPTS))]
    a = eng.generate(PROMPTS, 32, sampling=params)
    b = eng.generate(PROMPTS, 32, sampling=params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for i, p in enumerate(PROMPTS):
        alone = eng.generate([p], 32, sampling=[params[i]])
        assert alone[0].token_ids == a[i].token_ids
    # one seed for the batch: each request still gets its own stream (seed + index)
    one = eng.generate(PROMPTS[:2], 32, sampling=SamplingParams(temperature=1.0, seed=5))
    second_alone = eng.generate([PROMPTS[1]], 32, sampling=SamplingParams(temperature=1.0, seed=6))
    assert one[1].token_ids == second_alone[0].token_ids


def test_eos_stops_request_without_touching_others(pair):
    _, ours = pair
    eng = engine.Engine(ours)
    free = eng.generate(PROMPTS, 20)
    eos = free[0].token_ids[3]
    res = eng.generate(PROMPTS, 20, eos_token_id=eos)
    assert res[0].token_ids == free[0].token_ids[: free[0].token_ids.index(eos) + 1]
    assert res[0].finish_reason == "eos"
    for r, f in zip(res[1:], free[1:]):
        cut = f.token_ids.index(eos) + 1 if eos in f.token_ids else len(f.token_ids)
        assert r.token_ids == f.token_ids[:cut]


def test_all_blocks_free_after_requests_finish(pair):
    _, ours = pair
    eng = engine.Engine(ours, block_size=4)
    eng.generate(PROMPTS, 17, eos_token_id=3)
    eng.kv.check_quiescent()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompts=[[]]), "empty"),
        (dict(prompts=[1, 2, 3]), r"list of token-id lists.*flat list of ints"),
        (dict(prompts="def f(x):"), r"list of token-id lists, got a str: tokenize"),
        (dict(prompts=torch.tensor([1, 2, 3])), r"list of token-id lists, got a tensor: pass tensor.tolist"),
        (dict(prompts=[torch.tensor([1, 2, 3])]), r"prompt 0 must be a list of token ids, got Tensor"),
        (dict(sampling=[{"temperature": 1.0}]), "one per prompt.*of type dict"),
        (dict(prompts=[[1, 2, 97]]), "outside the vocabulary"),
        (dict(prompts=[[-1]]), "outside the vocabulary"),
        (dict(prompts=[[1] * 200], max_new_tokens=100), "context length"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(sampling=[SamplingParams()] * 3), "one per prompt"),
        (dict(spec=engine.SpecConfig(depth=2)), "needs a drafter"),
        (dict(eos_token_id=1000), "eos_token_id"),
    ],
)
def test_bad_input_is_rejected_before_work(pair, kwargs, match, monkeypatch):
    _, ours = pair
    eng = engine.Engine(ours)
    first = eng.generate([[1, 2]], 4)[0].token_ids  # a cache exists now: a rejected call must leave it as it was
    kv = eng.kv
    forwards = []
    monkeypatch.setattr(ours, "forward_batch", lambda *a, **k: forwards.append(a))
    args = dict(prompts=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        eng.generate(**args)
    assert not forwards, "a target forward ran before the input was rejected"
    assert eng.kv is kv and kv.num_free_blocks == kv.num_blocks and not kv.seqs
    monkeypatch.undo()
    assert eng.generate([[1, 2]], 4)[0].token_ids == first  # still usable: no session left open


def test_sampling_as_a_dict_says_what_to_pass(pair):
    _, ours = pair
    with pytest.raises(TypeError, match=r"engine.SamplingParams\(\*\*\{'temperature': 0.7\}\)"):
        engine.Engine(ours).generate([[1, 2]], 4, sampling={"temperature": 0.7})


def test_bad_sampling_params():
    for kw, match in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
