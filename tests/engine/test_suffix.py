"""SuffixIndex answers exactly what the prompt-lookup drafter's suffix matching answers."""

from __future__ import annotations

import math
import random

import pytest

from engine.drafting.suffix import SuffixIndex, suffix_continuations


def test_suffix_index_equals_the_reference_scan():
    rng = random.Random(1)
    for _ in range(5000):
        vocab = rng.choice([2, 3, 5, 20])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        path = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        ref = suffix_continuations(ctx + path, 1, 1, 4, 1)
        assert SuffixIndex(ctx).next_token(path, 4) == (ref[0][0] if ref else None), (ctx, path)


def test_suffix_continuations_known_answers():
    assert suffix_continuations([1, 2, 3, 1, 2], 2, 1) == [[3, 1]]  # "1 2" recurs: what followed it
    assert suffix_continuations([1, 2, 3], 2, 1) == []
    # width 2: distinct first tokens, most recent match first
    assert suffix_continuations([7, 1, 7, 2, 7], 1, 2) == [[2], [1]]


def test_ngram_drafter_trees_are_prefix_consistent_in_depth():
    """A depth-K n-gram draft is the depth-K prefix of the depth-K' > K one (what trace replay assumes); without
    a fixed selection depth the longest-continuation rule can pick another match for another K."""
    import random

    import torch

    from engine.drafting.ngram import NGramDrafter
    from engine.spec.config import SpecConfig
    from engine.spec.sampling import SamplingParams

    ctx = [5, 1, 2, 3, 9, 9, 9, 9, 1, 2, 3, 4, 1, 2]  # "1 2" recurs twice: most recent -> "3 4 ..", older -> "3 9 9 .."
    assert suffix_continuations(ctx, 2, 1) == [[3, 4]] and suffix_continuations(ctx, 8, 1)[0][:2] == [3, 9]
    assert suffix_continuations(ctx, 2, 1, select_depth=8) == [suffix_continuations(ctx, 8, 1)[0][:2]]
    drafter, rng = NGramDrafter(vocab_size=32), random.Random(0)

    def paths(tokens, k, w):
        t = drafter.draft(0, tokens, SpecConfig(depth=k, width=w), SamplingParams(), torch.Generator())
        tok, par = t.tokens.tolist(), t.parents.tolist()
        out = {}
        for i in range(1, len(tok)):
            out[i] = out.get(par[i], ()) + (tok[i],)
        return set(out.values())

    for _ in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        for w in (1, 2, 3):
            deep = paths(tokens, 8, w)
            for k in range(1, 8):
                assert paths(tokens, k, w) == {p for p in deep if len(p) <= k}


def test_ngram_drafter_scores_the_match_length_and_the_follower_frequency():
    """First token: (n / max_ngram) · its share of what followed the matched n-gram; d-th token: the suffix it then
    extends, min(max_ngram, n + d - 1) / max_ngram; path score = product; confidence = best score per depth.
    The threshold rule cuts by path score, as replay does."""
    import torch

    from engine.drafting.ngram import NGramDrafter
    from engine.drafting.suffix import suffix_match
    from engine.spec.config import SpecConfig
    from engine.spec.sampling import SamplingParams

    ctx = [5, 1, 2, 3, 9, 9, 9, 9, 1, 2, 7, 4, 1, 2]  # "1 2" recurs twice, followed by 3 and by 7
    m = suffix_match(ctx, 3, 2, select_depth=16)
    assert m.ngram == 2 and m.followers == {3: 1, 7: 1} and m.continuations == [[7, 4, 1], [3, 9, 9]]
    drafter = NGramDrafter(vocab_size=16)
    tree = drafter.draft(0, ctx, SpecConfig(depth=3, width=2), SamplingParams(), torch.Generator())
    assert tree.tokens.tolist() == [2, 7, 4, 1, 3, 9, 9]
    want = [1.0, 0.25, 0.25 * 0.75, 0.25 * 0.75, 0.25, 0.25 * 0.75, 0.25 * 0.75]
    assert tree.path_prob.tolist() == pytest.approx(want)
    assert tree.confidence == pytest.approx([0.25, 0.75, 1.0])
    cut = drafter.draft(0, ctx, SpecConfig(depth=3, width=2, verify_rule="threshold", verify_threshold=0.2),
                        SamplingParams(), torch.Generator())  # fmt: skip
    assert cut.tokens.tolist() == [2, 7, 3] and cut.confidence == pytest.approx([0.25])
    assert suffix_match([1, 2, 3], 2, 1).ngram == 0  # nothing recurs
    assert suffix_continuations(ctx, 0, 2) == suffix_continuations(ctx, 0, 2, select_depth=16) == []


def test_ngram_probe_is_the_round_s_confidence_and_the_draft_after_it_is_unchanged():
    """NGramDrafter.probe(depth, width) = the confidence of that draft (rule "all"); a draft after a probe, of at most
    its depth and width (any rule), equals the draft without one (it takes the probe's match, narrowed and cut), and
    the kept match is used once, for that sequence and that context only."""
    import random

    import torch

    from engine.drafting.acceptance import AcceptanceModel
    from engine.drafting.ngram import NGramDrafter
    from engine.spec.calibration import IsotonicCalibration
    from engine.spec.config import SpecConfig
    from engine.spec.sampling import SamplingParams

    rng = random.Random(3)
    fresh, probed = NGramDrafter(vocab_size=16), NGramDrafter(vocab_size=16)
    acc = AcceptanceModel(tuple(IsotonicCalibration(((0.0, 1.0),), ((p, 1.0),)) for p in (0.1, 0.3, 0.6)))
    rules = [("all", 0.0), ("threshold", 0.3), ("calibrated", 0.2)]

    def fields(t):
        return (t.tokens.tolist(), t.parents.tolist(), t.depths.tolist(), t.path_prob.tolist(), list(t.confidence))

    used = 0
    for trial in range(300):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(2, 50))]
        K, W = rng.randrange(1, 9), rng.randrange(1, 4)
        # the probe as a policy's session takes it (one call with its source) on odd trials: the same match kept
        conf = probed.probe(7, tokens, K, W) if trial % 2 == 0 else probed.probe_with_source(7, tokens, K, W)[0]
        full = fresh.draft(7, tokens, SpecConfig(depth=K, width=W), SamplingParams(), torch.Generator())
        assert conf == list(full.confidence), trial
        k, w = rng.randrange(1, K + 1), rng.randrange(1, W + 1)
        rule, thr = rules[trial % len(rules)]
        spec = SpecConfig(depth=k, width=w, verify_rule=rule, verify_threshold=thr,
                          acceptance=acc if rule == "calibrated" else None)  # fmt: skip
        other = tokens + [0] if trial % 5 == 0 else tokens  # another context: the probe is not taken
        want = fresh.draft(7, other, spec, SamplingParams(), torch.Generator())
        assert 7 in probed._probed
        used += other is tokens
        got = probed.draft(7, other, spec, SamplingParams(), torch.Generator())
        assert fields(got) == fields(want), trial
        assert 7 not in probed._probed  # used (or dropped) by that draft
    assert used > 200
    assert probed.probe(1, [1, 2, 1, 2], 0, 3) == [] and probed.probe(1, [1, 2, 3], 4, 2) == []  # nothing recurs
    probed.probe(2, [1, 2, 1], 4, 2)
    probed.commit(2, [1, 2, 1, 2], None, [])
    assert 2 not in probed._probed  # a commit drops it


def _reference_match(tokens, depth, width, max_ngram=4, min_ngram=1, select_depth=None):
    """suffix_match as first written: every earlier start scanned, most recent first."""
    from engine.drafting.suffix import SuffixMatch

    if depth <= 0:
        return SuffixMatch([], 0, {})
    cap = depth if select_depth is None else max(select_depth, depth)
    T = len(tokens)
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        suffix = tokens[T - n :]
        best, followers = {}, {}
        for start in range(T - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                cont = tokens[start + n : start + n + cap]
                followers[cont[0]] = followers.get(cont[0], 0) + 1
                if len(cont) > len(best.get(cont[0], [])):
                    if cont[0] not in best and len(best) == width:
                        continue
                    best[cont[0]] = cont
        if best:
            return SuffixMatch([c[:depth] for c in best.values()], n, followers)
    return SuffixMatch([], 0, {})


@pytest.mark.parametrize("impl", ["suffix_match", "suffix_match_py"])  # the C++ one where built, its Python twin
def test_suffix_match_scans_only_the_last_token_s_occurrences_with_the_same_result(impl):
    from engine.drafting import suffix

    suffix_match = getattr(suffix, impl)

    rng = random.Random(5)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 4, 9])) for _ in range(rng.randrange(0, 60))]
        args = (rng.randrange(0, 9), rng.randrange(1, 4), rng.randrange(1, 5))
        kw = dict(min_ngram=rng.randrange(1, args[2] + 1), select_depth=rng.choice([None, 8, 16]))
        assert suffix_match(tokens, *args, **kw) == _reference_match(tokens, *args, **kw), (tokens, args, kw)


def _match_source_reference(tokens: list[int], prompt_len: int, max_ngram: int = 4) -> tuple[float, float]:
    """The definition, scanned plainly: per n from the longest down, the most recent earlier occurrence."""
    import math

    T = len(tokens)
    for n in range(min(max_ngram, T - 1), 0, -1):
        for e in range(T - 2, n - 2, -1):
            if tokens[e - n + 1 : e + 1] == tokens[T - n :]:
                return 1.0 - min(math.log2(T - 1 - e + 1), 8.0) / 8.0, float(e + 1 >= prompt_len)
    return 0.0, 0.0


def test_match_source_known_answers_and_the_reference_scan():
    """(recency, in_output) of the longest recurring suffix's most recent occurrence: known answers, then 5,000
    random sequences against the plain scan."""
    from engine.drafting.suffix import match_source

    assert match_source([5], 0) == (0.0, 0.0)
    assert match_source([1, 2, 3], 3) == (0.0, 0.0)  # nothing recurs
    # "1 2" recurs, ending at index 1 (d = 3 tokens back); its continuation (index 2) lies in the prompt (length 4)
    assert match_source([1, 2, 9, 1, 2], 4) == (0.75, 0.0)
    assert match_source([1, 2, 9, 1, 2], 2) == (0.75, 1.0)  # ... in the output
    # a longer match further back wins over a shorter recent one: "7 1 2" at the start beats "2" just before
    assert match_source([7, 1, 2, 5, 2, 7, 1, 2], 8)[0] == 1.0 - math.log2(6) / 8
    rng = random.Random(0)
    for _ in range(5000):
        toks = [rng.randrange(rng.randint(2, 6)) for _ in range(rng.randint(1, 40))]
        P = rng.randint(0, len(toks))
        assert match_source(toks, P) == _match_source_reference(toks, P), (toks, P)


def test_ngram_probe_reports_its_match_source_from_the_prompt_length_of_start():
    """NGramDrafter.probed_source = match_source(tokens, the length `start` saw) after each probe; (0, 0) before a
    probe, after one that drafts nothing, and after `finish`."""
    from engine.drafting.ngram import NGramDrafter
    from engine.drafting.suffix import match_source

    d = NGramDrafter(16)
    prompt = [1, 2, 3, 4, 1, 2]
    d.start(0, prompt)
    assert d.probed_source(0) == (0.0, 0.0)
    tokens = prompt + [3, 4, 1]
    d.probe(0, tokens, 4, 2)
    assert d.probed_source(0) == match_source(tokens, len(prompt)) and d.probed_source(0)[0] > 0
    tokens += [2, 3]
    d.probe(0, tokens, 4, 2)
    assert d.probed_source(0) == match_source(tokens, len(prompt)) == (1.0 - math.log2(5) / 8, 1.0)
    d.probe(0, tokens, 0, 2)
    assert d.probed_source(0) == (0.0, 0.0)
    d.probe(0, tokens, 4, 2)
    d.finish(0)
    assert d.probed_source(0) == (0.0, 0.0)
