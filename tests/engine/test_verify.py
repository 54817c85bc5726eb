"""engine.verify.verify_tree: greedy known answers, exactness of every sampling mode, RNG use, errors.

Exactness tests draw NUM_SAMPLES rounds with a fixed seed and chi-square the committed tokens against
the target law (fail if p < 1e-6); acceptance is checked against Σ min(p, q) (2211.17192) and its
multi-draft generalisation (2305.09781). Run: pytest tests/engine/test_verify.py  (add -m slow for the
heavier multi-draft variant only).
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

import engine.spec.sampling as sampling
from engine.spec.sampling import SamplingParams, make_generator, process_logits, sample_from_probs
from engine.spec.verify import VerifyResult, verify_tree

# S=samples N=tree nodes V=vocab k=children of the root

V = 12
NUM_SAMPLES = 65_536
MIN_PVALUE = 1e-6
SAMPLE = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()


def _one_hot_rows(argmax_tokens: list[int]) -> torch.Tensor:
    """[N, V] one-hot target distributions (what process_logits gives for greedy)."""
    return torch.nn.functional.one_hot(torch.tensor(argmax_tokens), V).float()


def _target_and_draft() -> tuple[torch.Tensor, torch.Tensor]:
    """Random target / draft distributions [V] with mismatched supports in both directions."""
    gen = torch.Generator().manual_seed(1234)
    target_probs = torch.rand(V, generator=gen) ** 2
    draft_probs = torch.rand(V, generator=gen) ** 2
    target_probs[0] = 0.0  # the drafter proposes a token the target never emits
    draft_probs[1] = 0.0  # the target emits a token the drafter never proposes
    target_probs[2] = draft_probs[2] = 0.0  # empty for both
    return target_probs / target_probs.sum(), draft_probs / draft_probs.sum()


def _assert_law(tokens: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """tokens [S] follow expected_probs [V]: nothing off-support, chi-square over non-empty cells."""
    assert tokens.numel() > 0
    counts = torch.bincount(tokens, minlength=V).double()  # [V]
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the target support: {counts[~support]}"
    expected = expected_probs[support].double()
    expected = expected / expected.sum() * counts.sum()
    pvalue = scipy.stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > MIN_PVALUE, f"chi-square p={pvalue:.2e}: counts {counts.tolist()}"


def _multi_draft_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, num_children: int) -> float:
    """P(some root child accepted) for i.i.d. children under SpecInfer's residual updates."""
    residual = target_probs.double()
    draft = draft_probs.double()
    all_rejected = 1.0
    for _ in range(num_children):
        overlap = torch.minimum(residual, draft).sum().item()
        all_rejected *= 1.0 - overlap
        leftover = (residual - draft).clamp(min=0.0)
        if leftover.sum() > 0:
            residual = leftover / leftover.sum()
    return 1.0 - all_rejected


def _run_star(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    num_children: int,
    num_samples: int,
    bonus_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[VerifyResult]]:
    """Root with num_children i.i.d. drafted children (leaves). Returns first committed token [S],
    accepted flag [S], and the results."""
    num_nodes = 1 + num_children
    draft_gen = torch.Generator().manual_seed(99)
    children = torch.multinomial(draft_probs, num_samples * num_children, replacement=True, generator=draft_gen)
    tokens = torch.cat([torch.full((num_samples, 1), 3), children.view(num_samples, num_children)], dim=1)  # [S, N]
    parents = torch.tensor([-1] + [0] * num_children)
    leaf_probs = bonus_probs if bonus_probs is not None else target_probs
    target_rows = torch.stack([target_probs] + [leaf_probs] * num_children)  # [N, V]
    draft_rows = torch.zeros(num_nodes, V)  # leaf rows unused: zeros must be accepted
    draft_rows[0] = draft_probs
    generator = make_generator(2024, 0)
    results = [verify_tree(tokens[i], parents, target_rows, SAMPLE, generator, draft_rows) for i in range(num_samples)]
    first = torch.tensor([r.committed_tokens[0] for r in results])
    accepted = torch.tensor([r.accepted_len for r in results], dtype=torch.float64)
    return first, accepted, results


# --- greedy known answers -------------------------------------------------------------------------

CHAIN_TOKENS = [7, 1, 4, 9, 5]  # root 7, then drafted chain 1 -> 4 -> 9 -> 5 (K = 4)
CHAIN_PARENTS = [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("miss_depth", [1, 2, 3, 4])
@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sampled-one-hot"])
def test_greedy_chain_mismatch_at_each_depth(miss_depth: int, params: SamplingParams) -> None:
    # Target argmax after node i is the chain's next token, except at node miss_depth - 1 -> token 11.
    argmax = CHAIN_TOKENS[1:] + [6]
    argmax[miss_depth - 1] = 11
    result = verify_tree(
        torch.tensor(CHAIN_TOKENS),
        torch.tensor(CHAIN_PARENTS),
        _one_hot_rows(argmax),
        params,
        make_generator(0, 0),
    )
    assert result.accepted_nodes == list(range(1, miss_depth))
    assert result.committed_tokens == CHAIN_TOKENS[1:miss_depth] + [11]
    assert result.accepted_len == miss_depth - 1 and result.committed_len == miss_depth
    assert not result.bonus and result.rejection_depth == miss_depth
    assert result.children_tried == [1] * miss_depth


@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sampled-one-hot"])
def test_greedy_chain_full_accept_and_bonus(params: SamplingParams) -> None:
    argmax = CHAIN_TOKENS[1:] + [6]
    result = verify_tree(
        torch.tensor(CHAIN_TOKENS),
        torch.tensor(CHAIN_PARENTS),
        _one_hot_rows(argmax),
        params,
        make_generator(0, 0),
    )
    assert result.accepted_nodes == [1, 2, 3, 4]
    assert result.committed_tokens == [1, 4, 9, 5, 6]
    assert result.bonus and result.rejection_depth is None
    assert result.uniforms_drawn == (0 if params.greedy else 5)


def test_greedy_zero_drafts() -> None:
    result = verify_tree(torch.tensor([7]), torch.tensor([-1]), _one_hot_rows([3]), GREEDY, None)
    assert result == VerifyResult(
        accepted_nodes=[], committed_tokens=[3], bonus=True, rejection_depth=None, children_tried=[]
    )


def test_greedy_width_two_second_child_matches() -> None:
    #   0(7) -> 1(2) -> 3(8)
    #        -> 2(4) -> 4(5)      target: after 0 -> 4, after 2 -> 5, after 4 -> 10 (bonus)
    tokens = torch.tensor([7, 2, 4, 8, 5])
    parents = torch.tensor([-1, 0, 0, 1, 2])
    result = verify_tree(tokens, parents, _one_hot_rows([4, 8, 5, 0, 10]), GREEDY, None)
    assert result.accepted_nodes == [2, 4]
    assert result.committed_tokens == [4, 5, 10]
    assert result.bonus and result.children_tried == [2, 1]


def test_greedy_uses_argmax_of_raw_probs_first_on_ties() -> None:
    target_probs = torch.full((3, V), 0.01)
    target_probs[0, [4, 6]] = 0.3  # tie: argmax is token 4 (first index)
    target_probs[1, 9] = 0.5
    result = verify_tree(torch.tensor([7, 6, 4]), torch.tensor([-1, 0, 0]), target_probs, GREEDY, None)
    assert result.accepted_nodes == [2] and result.committed_tokens == [4, 0]  # row 2 is flat: argmax 0


def test_greedy_ignores_draft_probs_and_consumes_nothing() -> None:
    generator = make_generator(3, 0)
    state = generator.get_state()
    draft_probs = torch.full((2, V), 1.0 / V)
    result = verify_tree(
        torch.tensor([7, 1]), torch.tensor([-1, 0]), _one_hot_rows([1, 2]), GREEDY, generator, draft_probs
    )
    assert result.committed_tokens == [1, 2] and result.uniforms_drawn == 0
    assert torch.equal(generator.get_state(), state)


# --- exactness of sampled verification ------------------------------------------------------------


def test_chain_drafted_child_is_exact_and_acceptance_matches() -> None:
    target_probs, draft_probs = _target_and_draft()
    gen = torch.Generator().manual_seed(5)
    bonus_probs = torch.rand(V, generator=gen)
    bonus_probs /= bonus_probs.sum()
    first, accepted, results = _run_star(target_probs, draft_probs, 1, NUM_SAMPLES, bonus_probs)
    _assert_law(first, target_probs)
    expected_acceptance = torch.minimum(target_probs, draft_probs).sum().item()
    assert abs(accepted.mean().item() - expected_acceptance) < 0.01
    # After an accepted draft the bonus token is a plain sample of the leaf's target row.
    bonus_tokens = torch.tensor([r.committed_tokens[1] for r in results if r.bonus])
    _assert_law(bonus_tokens, bonus_probs)
    assert all(r.rejection_depth == 1 for r in results if not r.bonus)
    assert all(r.skipped_children == 0 for r in results)


@pytest.mark.parametrize("num_children", [2, 3])
def test_multi_draft_iid_children_is_exact(num_children: int) -> None:
    target_probs, draft_probs = _target_and_draft()
    first, accepted, results = _run_star(target_probs, draft_probs, num_children, NUM_SAMPLES // 4)
    _assert_law(first, target_probs)
    expected_acceptance = _multi_draft_acceptance(target_probs, draft_probs, num_children)
    assert abs(accepted.mean().item() - expected_acceptance) < 0.02
    assert all(r.children_tried[0] <= num_children for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("num_children", [2, 3])
def test_multi_draft_iid_children_is_exact_full(num_children: int) -> None:
    target_probs, draft_probs = _target_and_draft()
    first, accepted, _ = _run_star(target_probs, draft_probs, num_children, NUM_SAMPLES)
    _assert_law(first, target_probs)
    expected_acceptance = _multi_draft_acceptance(target_probs, draft_probs, num_children)
    assert abs(accepted.mean().item() - expected_acceptance) < 0.01


def test_deterministic_children_is_exact() -> None:
    #   root -> three top-W children of the drafter (distinct tokens), each with one child of its own
    target_probs, draft_probs = _target_and_draft()
    top_tokens = draft_probs.topk(3).indices.tolist()
    tokens = torch.tensor([3] + top_tokens + [top_tokens[0]] * 3)  # [N = 7]
    parents = torch.tensor([-1, 0, 0, 0, 1, 2, 3])
    gen = torch.Generator().manual_seed(6)
    child_rows = torch.rand(6, V, generator=gen)
    target_rows = torch.cat([target_probs[None], child_rows / child_rows.sum(-1, keepdim=True)])  # [N, V]
    generator = make_generator(77, 0)
    results = [verify_tree(tokens, parents, target_rows, SAMPLE, generator) for _ in range(NUM_SAMPLES)]
    first = torch.tensor([r.committed_tokens[0] for r in results])
    _assert_law(first, target_probs)
    # Given the walk accepted child c (the likeliest one), the next committed token follows row c.
    child = 1 + int(target_probs[top_tokens].argmax())
    second = torch.tensor([r.committed_tokens[1] for r in results if r.accepted_nodes[:1] == [child]])
    assert second.numel() > 1000
    _assert_law(second, target_rows[child])
    assert all(r.uniforms_drawn == r.committed_len for r in results)  # one uniform per visited node


def test_temperature_top_p_applied_identically_is_exact() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9)
    gen = torch.Generator().manual_seed(8)
    target_logits = 2.0 * torch.randn(V, generator=gen)
    draft_logits = target_logits + torch.randn(V, generator=gen)
    target_probs = process_logits(target_logits, params)
    draft_probs = process_logits(draft_logits, params)
    assert (target_probs == 0).any()  # top-p really truncates
    num_nodes = 3  # root with two i.i.d. drafted children
    draft_gen = torch.Generator().manual_seed(9)
    children = torch.multinomial(draft_probs, NUM_SAMPLES * 2, replacement=True, generator=draft_gen)
    tokens = torch.cat([torch.zeros(NUM_SAMPLES, 1, dtype=torch.long), children.view(-1, 2)], dim=1)
    parents = torch.tensor([-1, 0, 0])
    target_rows = target_probs.expand(num_nodes, V)
    draft_rows = draft_probs.expand(num_nodes, V)
    generator = make_generator(10, 0)
    first = torch.tensor(
        [verify_tree(t, parents, target_rows, params, generator, draft_rows).committed_tokens[0] for t in tokens]
    )
    _assert_law(first, process_logits(target_logits, params))


# --- random-stream contract -----------------------------------------------------------------------


@pytest.mark.parametrize("drafted", [False, True])
def test_zero_drafts_consume_exactly_one_uniform(drafted: bool) -> None:
    target_probs, draft_probs = _target_and_draft()
    plain = make_generator(42, 3)
    spec = make_generator(42, 3)
    for _ in range(50):
        plain_token = sample_from_probs(target_probs, plain)
        result = verify_tree(
            torch.tensor([5]),
            torch.tensor([-1]),
            target_probs[None],
            SAMPLE,
            spec,
            draft_probs[None] if drafted else None,
        )
        assert result.committed_tokens == [plain_token] and result.bonus
        assert result.uniforms_drawn == 1
        assert torch.equal(plain.get_state(), spec.get_state())


def test_seeded_calls_are_bit_identical() -> None:
    target_probs, draft_probs = _target_and_draft()
    tokens = torch.tensor([3, 4, 5, 6, 4])
    parents = torch.tensor([-1, 0, 0, 1, 1])
    target_rows = target_probs.expand(5, V)
    draft_rows = draft_probs.expand(5, V)

    def run(draft: torch.Tensor | None) -> list[VerifyResult]:
        generator = make_generator(123, 1)
        return [verify_tree(tokens, parents, target_rows, SAMPLE, generator, draft) for _ in range(200)]

    for draft in (None, draft_rows):
        first, second = run(draft), run(draft)
        assert first == second
        assert len({tuple(r.committed_tokens) for r in first}) > 1  # not trivially constant


# --- edge cases -----------------------------------------------------------------------------------


def test_zero_draft_prob_child_is_skipped_without_a_uniform() -> None:
    # Child token 1 has q = 0 (cannot have been drawn): skipped, p untouched, so the round is exactly
    # a plain target sample: same token, same generator state as one sample_from_probs call.
    target_probs, draft_probs = _target_and_draft()
    assert draft_probs[1] == 0
    generator, plain = make_generator(4, 0), make_generator(4, 0)
    result = verify_tree(
        torch.tensor([5, 1]),
        torch.tensor([-1, 0]),
        target_probs.expand(2, V),
        SAMPLE,
        generator,
        draft_probs.expand(2, V),
    )
    assert result.skipped_children == 1 and result.uniforms_drawn == 1 and result.children_tried == [1]
    assert result.committed_tokens == [sample_from_probs(target_probs, plain)]
    assert torch.equal(generator.get_state(), plain.get_state())


def test_zero_target_prob_child_is_always_rejected() -> None:
    target_probs, draft_probs = _target_and_draft()
    assert target_probs[0] == 0 and draft_probs[0] > 0
    generator = make_generator(5, 0)
    for _ in range(200):
        result = verify_tree(
            torch.tensor([5, 0]),
            torch.tensor([-1, 0]),
            target_probs.expand(2, V),
            SAMPLE,
            generator,
            draft_probs.expand(2, V),
        )
        assert result.accepted_len == 0 and result.rejection_depth == 1 and result.uniforms_drawn == 2
        assert target_probs[result.committed_tokens[0]] > 0


def test_zero_mass_residual_falls_back_to_target(monkeypatch: pytest.MonkeyPatch) -> None:
    # p == q: max(p - q, 0) has no mass. A rejection is then impossible for u in [0, 1); force one with
    # u = 1.0 and check the walk stays well defined and commits from p (here: its last non-zero token).
    target_probs, _ = _target_and_draft()
    monkeypatch.setattr(sampling, "draw_uniform", lambda generator: 1.0)
    monkeypatch.setattr("engine.spec.verify.draw_uniform", lambda generator: 1.0)
    rows = target_probs.expand(2, V)
    result = verify_tree(torch.tensor([5, 4]), torch.tensor([-1, 0]), rows, SAMPLE, None, rows)
    assert result.rejection_depth == 1
    assert result.committed_tokens == [int(torch.nonzero(target_probs)[-1])]


def test_ratio_rounding_above_one_accepts() -> None:
    target_probs, _ = _target_and_draft()
    draft_probs = target_probs.clone()
    draft_probs[4] *= 1 - 1e-7  # p / q slightly above 1 after renormalisation: always accepted
    generator = make_generator(6, 0)
    for _ in range(100):
        result = verify_tree(
            torch.tensor([5, 4]),
            torch.tensor([-1, 0]),
            target_probs.expand(2, V),
            SAMPLE,
            generator,
            draft_probs.expand(2, V),
        )
        assert result.accepted_nodes == [1]


# --- input validation -----------------------------------------------------------------------------


def _valid_inputs() -> dict:
    target_probs, draft_probs = _target_and_draft()
    return {
        "draft_tokens": torch.tensor([5, 4, 6]),
        "parents": torch.tensor([-1, 0, 1]),
        "target_probs": target_probs.expand(3, V).clone(),
        "draft_probs": draft_probs.expand(3, V).clone(),
    }


def _set(name: str, index: tuple, value: float):
    def edit(inputs: dict) -> None:
        inputs[name][index] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("target_probs", (1, 3), math.nan), "target_probs contains NaN"),
        (_set("target_probs", (0, 3), math.inf), "target_probs contains NaN or inf"),
        (_set("draft_probs", (2, 3), -math.inf), "draft_probs contains NaN or inf"),
        (_set("draft_probs", (2, 0), math.nan), "draft_probs contains NaN"),  # leaf row: still checked
        (_set("target_probs", (1, 3), -0.5), "negative"),
        (_set("parents", (2,), 2), "topological"),
        (_set("parents", (1,), 2), "topological"),
        (_set("parents", (0,), 0), r"parents\[0\] must be -1"),
        (_set("draft_tokens", (1,), V), r"draft_tokens must lie in \[0, V=12\)"),
        (lambda i: i.update(target_probs=i["target_probs"][:2]), "target_probs must be"),
        (lambda i: i.update(draft_probs=i["draft_probs"][:, :5]), "draft_probs must be"),
        (lambda i: i.update(parents=i["parents"][:2]), "parents must be"),
        (lambda i: i.update(draft_tokens=i["draft_tokens"].float()), "draft_tokens must be"),
        (lambda i: i.update(draft_tokens=torch.tensor([], dtype=torch.long)), "draft_tokens must be"),
        (lambda i: i.update(target_probs=torch.ones(3, V, dtype=torch.long)), "target_probs must be"),
        (lambda i: i["target_probs"][1].zero_(), r"target_probs\[1\] has zero mass"),
        (lambda i: i["draft_probs"][0].zero_(), r"draft_probs\[0\] has zero mass"),
    ],
)
def test_bad_inputs_raise_before_any_randomness(edit, message: str) -> None:
    inputs = _valid_inputs()
    edit(inputs)
    generator = make_generator(0, 0)
    state = generator.get_state()
    with pytest.raises(ValueError, match=message):
        verify_tree(
            inputs["draft_tokens"],
            inputs["parents"],
            inputs["target_probs"],
            SAMPLE,
            generator,
            inputs["draft_probs"],
        )
    assert torch.equal(generator.get_state(), state)


def test_zero_mass_leaf_draft_row_is_allowed() -> None:
    """Node 2 is a leaf: its drafter row is never read, so zeroing it changes no outcome (same seeds)."""
    inputs = _valid_inputs()
    inputs["draft_tokens"] = torch.tensor([5, 10, 3])  # p/q: 10 is always accepted, 3 about a third of the time
    zeroed = inputs["draft_probs"].clone()
    zeroed[2].zero_()
    reached_leaf = 0
    for seed in range(64):
        args = (inputs["draft_tokens"], inputs["parents"], inputs["target_probs"], SAMPLE)
        ref = verify_tree(*args, make_generator(seed, 0), inputs["draft_probs"])
        got = verify_tree(*args, make_generator(seed, 0), zeroed)
        assert got == ref, seed
        reached_leaf += got.accepted_nodes == [1, 2]
    assert 0 < reached_leaf < 64  # the walk did get to the leaf whose row is zero, and stopped before it too


def test_greedy_reads_raw_logits_like_their_one_hots() -> None:
    """The engine hands greedy verification the logits (no [N, V] one-hot): same walk, same tokens, ties included."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        n, vocab = int(torch.randint(1, 12, (1,), generator=g)), 9
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        tokens = torch.randint(0, vocab, (n,), generator=g)
        logits = torch.randint(-3, 3, (n, vocab), generator=g).float()  # coarse values: many ties
        if trial % 3 == 0:  # make the draft agree with the target somewhere
            tokens[1:] = logits.argmax(-1)[parents[1:]]
        a = verify_tree(tokens, parents, logits, GREEDY, None)
        b = verify_tree(tokens, parents, process_logits(logits, GREEDY), GREEDY, None)
        assert a == b
