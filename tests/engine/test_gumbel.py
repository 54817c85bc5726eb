"""engine.spec.gumbel: position-keyed Gumbel-max sampling (2408.07978) and its tree verification.

(a) y_p over many seeds follows the processed target law (chi-square, p > 1e-3), also jointly over two
positions; (b) the noise depends on (seed, position) only, bit for bit against a pure-Python SplitMix64;
(c) chain acceptance under shared noise >= (1 - TV) / (1 + TV) and equals its exact value; (d) verify_gumbel
commits the position-by-position y sequence whatever the tree; (e) errors.
Run: pytest tests/engine/test_gumbel.py
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

from engine.spec import gumbel
from engine.spec.gumbel import gumbel_argmax, gumbel_top_w, position_gumbel, position_gumbel_many, verify_gumbel
from engine.spec.sampling import SamplingParams, process_logits

# S=samples (seeds) N=tree nodes D=depth levels V=vocab

NUM_SEEDS = 20_000
MIN_PVALUE = 1e-3
LAWS = [
    ("t1", SamplingParams(temperature=1.0)),
    ("t0.7-p0.8", SamplingParams(temperature=0.7, top_p=0.8)),
]


def _random_logits(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _chisquare_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """counts, probs [C]: nothing may land off-support; chi-square over the support."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"samples outside the support: {counts.tolist()} vs {probs.tolist()}"
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    return scipy.stats.chisquare(counts[support].double().numpy(), expected.numpy()).pvalue


# ---------------------------------------------------------------- (a) exact target law


@pytest.mark.parametrize("vocab", [5, 8])
@pytest.mark.parametrize(("name", "params"), LAWS, ids=[n for n, _ in LAWS])
def test_position_sample_follows_processed_target_law(vocab, name, params):
    target_probs = process_logits(_random_logits(vocab, seed=vocab), params)  # [V]
    if name != "t1":
        assert (target_probs == 0).any(), "top-p should truncate this law (test is meant to cover it)"
    noise = position_gumbel_many(range(NUM_SEEDS), 7, vocab)  # [S, V]: one sample per seed
    tokens = gumbel_argmax(target_probs.log().expand(NUM_SEEDS, vocab), noise)  # [S]
    pvalue = _chisquare_pvalue(torch.bincount(tokens, minlength=vocab), target_probs)
    assert pvalue > MIN_PVALUE, f"{name} V={vocab}: chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize(("name", "params"), LAWS, ids=[n for n, _ in LAWS])
def test_samples_at_two_positions_are_independent(name, params):
    vocab = 6
    probs_a = process_logits(_random_logits(vocab, seed=1), params)
    probs_b = process_logits(_random_logits(vocab, seed=2), params)
    seeds = list(range(NUM_SEEDS))
    tokens_a = gumbel_argmax(probs_a.log().expand(NUM_SEEDS, vocab), position_gumbel_many(seeds, 30, vocab))
    tokens_b = gumbel_argmax(probs_b.log().expand(NUM_SEEDS, vocab), position_gumbel_many(seeds, 31, vocab))
    counts = torch.bincount(tokens_a * vocab + tokens_b, minlength=vocab * vocab)  # [V * V]
    pvalue = _chisquare_pvalue(counts, torch.outer(probs_a, probs_b).reshape(-1))
    assert pvalue > MIN_PVALUE, f"{name}: joint (y_30, y_31) chi-square p = {pvalue:.2e}"


def test_noise_is_standard_gumbel():
    noise = position_gumbel_many(range(50), range(50), 4096).reshape(-1)  # 204,800 values
    pvalue = scipy.stats.kstest(noise.numpy(), "gumbel_r").pvalue
    assert pvalue > MIN_PVALUE, f"KS vs Gumbel(0, 1): p = {pvalue:.2e}"
    extremes = gumbel._bits_to_gumbel(torch.tensor([0, 2**52 - 1]))
    assert torch.isfinite(extremes).all() and extremes[0] < -3.5 and extremes[1] > 36


# ---------------------------------------------------------------- (b) keyed on (seed, position) only

_MASK = 2**64 - 1


def _mix64_reference(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _bits_reference(seed: int, position: int, token: int) -> int:
    """Unsigned Python ints: the documented key mixing, independent of torch's int64 wrapping."""
    gamma = 0x9E3779B97F4A7C15
    key = _mix64_reference((_mix64_reference(seed % 2**64) + (position + 1) * gamma) & _MASK)
    return _mix64_reference((key + (token + 1) * gamma) & _MASK) >> 12


@pytest.mark.parametrize(("seed", "position"), [(0, 0), (1, 17), (2**63, 5), (2**64 - 1, 2**40), (123456789, 3)])
def test_bits_match_pure_python_reference(seed, position):
    vocab = 37
    signed_seed = seed - 2**64 if seed >= 2**63 else seed
    bits = gumbel._position_bits(torch.tensor([signed_seed]), torch.tensor([position]), vocab)[0]
    assert bits.tolist() == [_bits_reference(seed, position, v) for v in range(vocab)]
    expected = gumbel._bits_to_gumbel(bits)
    assert torch.equal(position_gumbel(seed, position, vocab), expected)


def test_noise_independent_of_batching_and_call_order():
    vocab = 64
    pairs = [(3, 10), (3, 11), (4, 10), (0, 0), (3, 10)]
    singles = [position_gumbel(s, p, vocab) for s, p in pairs]
    backwards = [position_gumbel(s, p, vocab) for s, p in reversed(pairs)][::-1]
    batched = position_gumbel_many([s for s, _ in pairs], torch.tensor([p for _, p in pairs]), vocab)
    for single, back, row in zip(singles, backwards, batched):
        assert single.dtype == torch.float64 and single.shape == (vocab,)
        assert torch.equal(single, back) and torch.equal(single, row)
    assert torch.equal(singles[0], singles[4])
    assert not torch.equal(singles[0], singles[1]) and not torch.equal(singles[0], singles[2])
    # broadcasting one seed over positions, a larger vocabulary extends (does not reshuffle) the row
    assert torch.equal(position_gumbel_many(3, [10, 11], vocab), batched[:2])
    assert torch.equal(position_gumbel(3, 10, 2 * vocab)[:vocab], singles[0])
    assert torch.equal(position_gumbel(3 + 2**64, 10, vocab), singles[0])  # seeds are taken mod 2**64
    assert torch.equal(position_gumbel(3, 10, vocab, torch.device("cpu")), singles[0])


def test_argmax_same_for_float32_and_float64_logprobs():
    vocab = 50
    logprobs = torch.log_softmax(_random_logits(vocab, seed=5, scale=3.0).expand(200, vocab), dim=-1)  # float32
    noise = position_gumbel_many(7, range(200), vocab)
    assert torch.equal(gumbel_argmax(logprobs, noise), gumbel_argmax(logprobs.double(), noise))
    assert torch.equal(gumbel_argmax(logprobs, noise), gumbel_top_w(logprobs, noise, 3)[:, 0])


def test_coupled_probs_rank_like_the_gumbel_order():
    vocab = 30
    logprobs = torch.log_softmax(_random_logits(vocab, seed=6, scale=2.0).expand(50, vocab), dim=-1)
    noise = position_gumbel_many(8, range(50), vocab)
    probs = gumbel.coupled_probs(logprobs, noise)  # [50, V]
    assert probs.dtype == torch.float64
    torch.testing.assert_close(probs.sum(-1), torch.ones(50, dtype=torch.float64))
    children = gumbel_top_w(logprobs, noise, 4)  # [50, 4]
    ranked = probs.gather(1, children)
    assert (ranked[:, :-1] >= ranked[:, 1:]).all(), "siblings must keep their Gumbel order"
    assert torch.equal(probs.argmax(-1), gumbel_argmax(logprobs, noise))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_same_on_cuda():
    seeds, positions = list(range(8)), list(range(100, 108))
    cpu_bits = gumbel._position_bits(torch.tensor(seeds), torch.tensor(positions), 4096)
    cuda_bits = gumbel._position_bits(torch.tensor(seeds).cuda(), torch.tensor(positions).cuda(), 4096)
    assert torch.equal(cpu_bits, cuda_bits.cpu())
    cpu, cuda = position_gumbel_many(seeds, positions, 4096), position_gumbel_many(seeds, positions, 4096, "cuda")
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=4e-16, atol=4e-16)


# ---------------------------------------------------------------- (c) coupling bound


def _exact_chain_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """P(argmin E/q = argmin E/p) = Σ_i 1 / Σ_j max(p_j / p_i, q_j / q_i) over tokens both give mass."""
    p, q = target_probs.double(), draft_probs.double()
    total = 0.0
    for i in range(p.numel()):
        if p[i] > 0 and q[i] > 0:
            total += 1.0 / torch.maximum(p / p[i], q / q[i]).sum().item()
    return total


@pytest.mark.parametrize(("pair_seed", "mismatch"), [(0, 0.3), (1, 1.0), (2, 3.0)])
def test_chain_acceptance_meets_coupling_bound(pair_seed, mismatch):
    """Drafter logits = target logits + mismatch * N(0, 1): close, middling and unrelated pairs."""
    vocab = 8
    target_logits = _random_logits(vocab, seed=100 + pair_seed, scale=2.0)
    draft_logits = target_logits + _random_logits(vocab, seed=200 + pair_seed, scale=mismatch)
    target_probs = process_logits(target_logits, SamplingParams(0.7))
    draft_probs = process_logits(draft_logits, SamplingParams(1.0))
    noise = position_gumbel_many(range(NUM_SEEDS), 12, vocab)  # [S, V]
    target_tokens = gumbel_argmax(target_probs.log().expand(NUM_SEEDS, vocab), noise)
    draft_children = gumbel_top_w(draft_probs.log().expand(NUM_SEEDS, vocab), noise, 3)  # [S, 3]
    accepted_by_width = [
        (draft_children[:, :w] == target_tokens[:, None]).any(1).double().mean().item() for w in (1, 2, 3)
    ]
    accepted = accepted_by_width[0]

    tv = 0.5 * (target_probs - draft_probs).abs().sum().item()
    bound = (1 - tv) / (1 + tv)
    exact = _exact_chain_acceptance(target_probs, draft_probs)
    sigma = math.sqrt(exact * (1 - exact) / NUM_SEEDS)
    message = (
        f"TV {tv:.3f}: measured {accepted:.4f}, exact {exact:.4f}, bound {bound:.4f}, "
        f"1-TV {1 - tv:.4f}; top-W acceptance W=1,2,3 {accepted_by_width}"
    )
    assert accepted >= bound - 4 * sigma, message
    assert abs(accepted - exact) < 4 * sigma, message
    assert exact >= bound - 1e-12, message  # the bound of 2408.07978 holds for the exact value too
    assert accepted_by_width[0] <= accepted_by_width[1] <= accepted_by_width[2], message


# ---------------------------------------------------------------- (d) invariance of the committed text

VOCAB = 10
PROMPT = [1, 4, 2]
NEW_TOKENS = 40
LEVELS = 12  # noise rows per round: deeper than any tree built below (random trees have <= 11 nodes)
DRAFT = SamplingParams(temperature=1.0)


def _context_law(context: list[int], params: SamplingParams, salt: int = 1000) -> torch.Tensor:
    """A mock model (target: salt 1000): processed next-token law [V] given the last two tokens."""
    key = salt + context[-2] * VOCAB + context[-1]
    return process_logits(_random_logits(VOCAB, seed=key, scale=2.0), params)


def _reference(seed: int, params: SamplingParams) -> list[int]:
    seq = list(PROMPT)
    while len(seq) < len(PROMPT) + NEW_TOKENS:
        noise = position_gumbel(seed, len(seq), VOCAB).unsqueeze(0)
        seq.append(int(gumbel_argmax(_context_law(seq, params).log().unsqueeze(0), noise)[0]))
    return seq[len(PROMPT) :]


def _build_tree(kind: str, seq: list[int], noise: torch.Tensor, params: SamplingParams, gen: torch.Generator):
    """(tokens [N], parents [N]) of a draft tree rooted at seq[-1]; kinds: empty, random, perfect, drafter."""
    tokens, parents = [seq[-1]], [-1]
    if kind == "random":
        for node in range(1, 1 + int(torch.randint(1, 12, (), generator=gen))):
            parents.append(int(torch.randint(0, node, (), generator=gen)))
            tokens.append(int(torch.randint(0, VOCAB, (), generator=gen)))
    elif kind in ("perfect", "drafter"):
        depth, width = 3, 2
        frontier = [0]
        for d in range(depth):
            next_frontier = []
            for node in frontier:
                context = seq + _path(tokens, parents, node)
                law = _context_law(context, params) if kind == "perfect" else _context_law(context, DRAFT, 5000)
                for child in gumbel_top_w(law.log().unsqueeze(0), noise[d : d + 1], width)[0].tolist():
                    tokens.append(child)
                    parents.append(node)
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier[:3]
    return torch.tensor(tokens), torch.tensor(parents)


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """Tokens from the root's first child down to node (root excluded)."""
    path = []
    while parents[node] >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def _speculate(seed: int, params: SamplingParams, kind: str) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    seq = list(PROMPT)
    accepted_lens = []
    while len(seq) < len(PROMPT) + NEW_TOKENS:
        noise = position_gumbel_many(seed, [len(seq) + d for d in range(LEVELS)], VOCAB)  # [D, V]
        tokens, parents = _build_tree(kind, seq, noise, params, gen)
        tok_list, par_list = tokens.tolist(), parents.tolist()
        target_probs = torch.stack(
            [_context_law(seq + _path(tok_list, par_list, n), params) for n in range(len(tok_list))]
        )
        result = verify_gumbel(tokens, parents, target_probs, noise)
        assert result.uniforms_drawn == 0 and result.committed_len == result.accepted_len + 1
        assert result.bonus == (result.rejection_depth is None)
        accepted_lens.append(result.accepted_len)
        seq.extend(result.committed_tokens)
    return seq[len(PROMPT) : len(PROMPT) + NEW_TOKENS], accepted_lens


@pytest.mark.parametrize(
    ("name", "params"), LAWS + [("greedy", SamplingParams())], ids=[n for n, _ in LAWS] + ["greedy"]
)
@pytest.mark.parametrize("seed", [0, 7])
def test_committed_text_is_independent_of_the_tree(name, params, seed):
    expected = _reference(seed, params)
    for kind in ("empty", "random", "perfect", "drafter"):
        committed, accepted_lens = _speculate(seed, params, kind)
        assert committed == expected, f"{name} seed {seed}: {kind} tree changed the text"
        if kind == "empty":
            assert set(accepted_lens) == {0}
        if kind == "perfect":  # the target's own Gumbel-top-W children: every level is accepted
            assert set(accepted_lens) == {3}, accepted_lens


def test_verify_gumbel_known_walk():
    """Root 0 -> children 1 (token 3), 2 (token 5); node 2 -> child 3 (token 7). One-hot targets."""
    tokens, parents = torch.tensor([9, 3, 5, 7]), torch.tensor([-1, 0, 0, 2])
    noise = position_gumbel_many(0, [0, 1, 2], VOCAB)

    def one_hot(rows):
        return torch.nn.functional.one_hot(torch.tensor(rows), VOCAB).float()

    result = verify_gumbel(tokens, parents, one_hot([5, 0, 7, 4]), noise)  # accept 2, accept 3, bonus 4
    assert (result.accepted_nodes, result.committed_tokens, result.bonus) == ([2, 3], [5, 7, 4], True)
    assert result.children_tried == [2, 1] and result.rejection_depth is None
    result = verify_gumbel(tokens, parents, one_hot([5, 0, 1, 4]), noise)  # accept 2, reject at depth 2
    assert (result.accepted_nodes, result.committed_tokens, result.rejection_depth) == ([2], [5, 1], 2)
    result = verify_gumbel(tokens, parents, one_hot([8, 0, 1, 4]), noise)  # reject at depth 1: recovered 8
    assert (result.committed_tokens, result.rejection_depth, result.children_tried) == ([8], 1, [2])


# ---------------------------------------------------------------- (e) errors


def test_bad_inputs_raise_value_error():
    noise = position_gumbel_many(0, [0, 1], 4)
    probs = torch.full((2, 4), 0.25)
    bad_calls = [
        lambda: position_gumbel(-1, 0, 4),
        lambda: position_gumbel(0, -1, 4),
        lambda: position_gumbel(0, 0, 0),
        lambda: position_gumbel(0.5, 0, 4),
        lambda: position_gumbel(True, 0, 4),
        lambda: position_gumbel_many([0, 1], [0, 1, 2], 4),
        lambda: position_gumbel_many([0], torch.tensor([0.0]), 4),
        lambda: position_gumbel_many([0], [2**62], 4),
        lambda: gumbel_argmax(probs[0], noise[0]),
        lambda: gumbel_argmax(probs, noise[:1]),
        lambda: gumbel_argmax(probs.long(), noise),
        lambda: gumbel_top_w(probs, noise, 0),
        lambda: gumbel_top_w(probs, noise, 5),
        lambda: verify_gumbel(torch.tensor([0, 1]), torch.tensor([-1, 0]), probs, noise[:1]),  # D <= max depth
        lambda: verify_gumbel(torch.tensor([0, 1]), torch.tensor([-1, 0]), probs, noise[:, :3]),  # V mismatch
        lambda: verify_gumbel(torch.tensor([0, 1]), torch.tensor([-1, 0]), probs[:1], noise),  # N mismatch
        lambda: verify_gumbel(torch.tensor([0, 1]), torch.tensor([0, 0]), probs, noise),  # root parent
        lambda: verify_gumbel(torch.tensor([0, 9]), torch.tensor([-1, 0]), probs, noise),  # token >= V
        lambda: verify_gumbel(torch.tensor([0, 1]), torch.tensor([-1, 0]), -probs, noise),  # negative probs
    ]
    for index, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {index} did not raise")


def test_gumbel_argmax_equals_torchs_argmax_of_the_perturbed_rows():
    """The CPU path (numpy's argmax) picks what torch.argmax picks, masked (-inf) tokens and an all -inf row
    included, as a LongTensor [N]."""
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(6, 512, generator=g), -1)
    lp[0, :100] = float("-inf")
    lp[1, :] = float("-inf")
    noise = position_gumbel_many(7, range(6), 512, "cpu")
    got = gumbel_argmax(lp, noise)
    assert got.dtype == torch.int64 and got.shape == (6,)
    assert torch.equal(got, (lp.double() + noise.double()).argmax(dim=-1))
