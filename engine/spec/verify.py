"""Exact verification of a draft tree against the target distributions (DESIGN.md §2).

Tree layout (topological; node 0 is the root = the last committed token, parents[0] = -1)::

    node:    0      1     2     3     4          depth 0:  0
    parent: -1      0     0     1     1          depth 1:  1   2        children tried in index order
                                                 depth 2:  3 4

`target_probs[i]` is the processed target next-token distribution after node i (what
`engine.sampling.process_logits` returns); `draft_probs[i]`, when given, is the processed drafter
distribution from which node i's children were drawn i.i.d. (with replacement).

Vocabulary: *accepted* nodes form the path kept from the root; the walk then commits one more token,
either *recovered* (sampled by the target where the walk stopped on a rejection) or *bonus* (sampled
after the path reached a leaf). committed = accepted tokens + that one token.

Modes, chosen by `params.greedy` and whether `draft_probs` is given:

- greedy: follow the first child whose token is argmax target_probs[node]; commit the argmax at the
  first miss (recovered) or at a leaf (bonus). Identical tokens to target-only greedy decoding.
- sampling, deterministic children (draft_probs None, e.g. the drafter's top-W): draw
  y = sample_from_probs(target_probs[node]); descend to the first child with token y, else commit y.
  This *is* target sampling, one uniform per visited node, so a zero-draft round (N = 1) draws exactly
  the one uniform plain decoding would.
- sampling, drafted children: speculative sampling (Leviathan et al. 2211.17192; Chen et al.
  2302.01318) for a single child, generalised to several i.i.d. children by SpecInfer's multi-step
  speculative sampling (Miao et al. 2305.09781). At a node with target p and drafter q, for each child
  x in order: draw u; accept if u < min(1, p(x) / q(x)); else p <- normalise(max(p - q, 0)) and try the
  next child. If every child is rejected, commit a sample from the residual p; at a leaf commit a sample
  from target_probs[leaf] (bonus). Each step is an exact speculative-sampling step against the current
  residual with a fresh q-sample, so the committed law is the target's.

Edge cases (drafted children):

- q(x) = 0 for a drafted child x: x cannot have been drawn from q, so draft_probs is not the law the
  child came from. The child is skipped: no uniform is drawn and p is left unchanged, i.e. the walk
  behaves as if that child had not been drafted (the remaining children are still i.i.d. q-draws, so
  the result stays exact for them). Counted in `VerifyResult.skipped_children`.
- p(x) / q(x) rounding above 1 is clamped by the min(1, .) (and u < 1 always accepts then).
- max(p - q, 0) with zero mass: in exact arithmetic that means p <= q everywhere, hence p == q, and
  then a rejection has probability 0. Reaching it needs rounding, on an event of probability at most
  sum |p - q| (~1e-16); we keep p itself, the law the commit must follow anyway, so no mass is lost.
- p and q rows are renormalised in float64 before ratios, so float32 rows summing to 1 +- 1e-7 are fine.

Inputs are validated (shapes, dtypes, topological order, token range, finite non-negative rows) and
raise ValueError before any randomness is consumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.spec.sampling import SamplingParams, draw_uniform, row_argmax, sample_from_probs

# N=tree nodes (root included) V=vocab

__all__ = ["VerifyResult", "verify_tree"]


@dataclass
class VerifyResult:
    """Outcome of one verification walk.

    accepted_nodes:   tree node indices on the accepted path, root excluded, in depth order.
    committed_tokens: tokens of the accepted nodes, then one recovered or bonus token.
    bonus:            True if the last committed token is a bonus (the path reached a leaf; also for
                      N = 1, where the root is the leaf).
    rejection_depth:  depth (1-based, of the children level) where the walk stopped on a rejection;
                      None when bonus.
    children_tried:   [d - 1] = children examined at depth d before acceptance or giving up; one entry
                      per depth level the walk attempted (len = accepted_len + (not bonus)). Acceptance
                      by depth: level d was attempted iff d <= len(children_tried), accepted iff
                      d <= accepted_len.
    uniforms_drawn:   uniforms consumed from the generator (0 for greedy).
    skipped_children: drafted children ignored because draft_probs gave them zero probability
                      (should be 0 when draft_probs is really the law the children were drawn from).
    """

    accepted_nodes: list[int]
    committed_tokens: list[int]
    bonus: bool
    rejection_depth: int | None
    children_tried: list[int] = field(default_factory=list)
    uniforms_drawn: int = 0
    skipped_children: int = 0

    @property
    def accepted_len(self) -> int:
        return len(self.accepted_nodes)

    @property
    def committed_len(self) -> int:
        return len(self.committed_tokens)


@dataclass(frozen=True)
class _Tree:
    tokens: list[int]  # [N]
    children: list[list[int]]  # [N][*], increasing index = try order
    depths: list[int]  # [N], root 0


def verify_tree(
    draft_tokens: Tensor,
    parents: Tensor,
    target_probs: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: Tensor | None = None,
) -> VerifyResult:
    """Walk the draft tree from the root and decide what to commit (modes: module docstring).

    draft_tokens: LongTensor [N]; draft_tokens[0] is the root (last committed) token.
    parents:      LongTensor [N]; parents[0] = -1, 0 <= parents[i] < i for i > 0.
    target_probs: FloatTensor [N, V]; processed target distribution after each node (greedy reads only its
                  argmax, so raw logits, probabilities or one-hots all work, and their rows are not checked).
    params:       the request's SamplingParams (only `greedy` matters here: temperature / top-k / top-p
                  must already be applied to target_probs and draft_probs, identically).
    generator:    the request's stream (None: torch's default generator; unused when greedy).
    draft_probs:  FloatTensor [N, V] or None; drafter law each node's children were drawn from i.i.d.
                  None = deterministic children. Ignored when greedy.
    """
    tree = _check_inputs(draft_tokens, parents, target_probs, draft_probs, rows=not params.greedy)
    if params.greedy:
        return _walk_greedy(tree, target_probs)
    if draft_probs is None:
        return _walk_deterministic_children(tree, target_probs, generator)
    return _walk_drafted_children(tree, target_probs, draft_probs, generator)


def _walk_greedy(tree: _Tree, target_probs: Tensor) -> VerifyResult:
    target_argmax = row_argmax(target_probs)  # [N]; first index on ties
    accepted: list[int] = []
    children_tried: list[int] = []
    node = 0
    while True:
        token = target_argmax[node]
        kids = tree.children[node]
        if not kids:
            return _result(tree, accepted, token, None, children_tried, 0, 0)
        tried, match = _first_match(tree, kids, token)
        children_tried.append(tried)
        if match is None:
            return _result(tree, accepted, token, tree.depths[node] + 1, children_tried, 0, 0)
        accepted.append(match)
        node = match


def _walk_deterministic_children(tree: _Tree, target_probs: Tensor, generator: torch.Generator | None) -> VerifyResult:
    accepted: list[int] = []
    children_tried: list[int] = []
    node = 0
    uniforms = 0
    while True:
        token = sample_from_probs(target_probs[node], generator)
        uniforms += 1
        kids = tree.children[node]
        if not kids:
            return _result(tree, accepted, token, None, children_tried, uniforms, 0)
        tried, match = _first_match(tree, kids, token)
        children_tried.append(tried)
        if match is None:
            return _result(tree, accepted, token, tree.depths[node] + 1, children_tried, uniforms, 0)
        accepted.append(match)
        node = match


def _walk_drafted_children(
    tree: _Tree, target_probs: Tensor, draft_probs: Tensor, generator: torch.Generator | None
) -> VerifyResult:
    # 2211.17192 (one child) / 2305.09781 multi-step speculative sampling (several i.i.d. children).
    accepted: list[int] = []
    children_tried: list[int] = []
    node = 0
    uniforms = 0
    skipped = 0
    while True:
        kids = tree.children[node]
        if not kids:
            token = sample_from_probs(target_probs[node], generator)  # bonus: plain target sample
            return _result(tree, accepted, token, None, children_tried, uniforms + 1, skipped)
        residual_probs = _normalised(target_probs[node])  # [V] float64; p, then the residual
        node_draft_probs = _normalised(draft_probs[node])  # [V] float64; q
        kid_tokens = [tree.tokens[c] for c in kids]
        draft_at_kids = node_draft_probs[kid_tokens].tolist()
        match = None
        tried = 0
        for kid, kid_token, draft_p in zip(kids, kid_tokens, draft_at_kids):
            tried += 1
            if draft_p <= 0.0:
                skipped += 1  # could not have been drawn from q: ignore it (module docstring)
                continue
            target_p = residual_probs[kid_token].item()
            u = draw_uniform(generator)
            uniforms += 1
            if u < min(1.0, target_p / draft_p):
                match = kid
                break
            leftover = (residual_probs - node_draft_probs).clamp_(min=0.0)
            leftover_mass = leftover.sum().item()
            if leftover_mass > 0.0:
                residual_probs = leftover / leftover_mass
            # else p == q up to rounding: keep p (module docstring).
        children_tried.append(tried)
        if match is None:
            token = sample_from_probs(residual_probs, generator)  # recovered
            rejection_depth = tree.depths[node] + 1
            return _result(tree, accepted, token, rejection_depth, children_tried, uniforms + 1, skipped)
        accepted.append(match)
        node = match


def _first_match(tree: _Tree, kids: list[int], token: int) -> tuple[int, int | None]:
    """(children examined, first child whose token is `token` or None)."""
    for position, kid in enumerate(kids):
        if tree.tokens[kid] == token:
            return position + 1, kid
    return len(kids), None


def _result(
    tree: _Tree,
    accepted: list[int],
    last_token: int,
    rejection_depth: int | None,
    children_tried: list[int],
    uniforms: int,
    skipped: int,
) -> VerifyResult:
    return VerifyResult(
        accepted_nodes=accepted,
        committed_tokens=[tree.tokens[n] for n in accepted] + [int(last_token)],
        bonus=rejection_depth is None,
        rejection_depth=rejection_depth,
        children_tried=children_tried,
        uniforms_drawn=uniforms,
        skipped_children=skipped,
    )


def _normalised(row: Tensor) -> Tensor:
    row = row.to(torch.float64)
    return row / row.sum()


def _check_inputs(draft_tokens: Tensor, parents: Tensor, target_probs: Tensor, draft_probs: Tensor | None,
                  rows: bool = True) -> _Tree:  # fmt: skip
    """Validate everything up front (no randomness consumed on error); build children lists. rows: check the
    distributions' entries (greedy reads only the argmax of target_probs, which may be logits)."""
    if draft_tokens.dim() != 1 or draft_tokens.numel() == 0 or _not_integer(draft_tokens):
        raise ValueError(
            "draft_tokens must be a non-empty 1-D integer tensor [N], "
            f"got shape {tuple(draft_tokens.shape)} dtype {draft_tokens.dtype}"
        )
    num_nodes = draft_tokens.numel()
    if parents.shape != (num_nodes,) or _not_integer(parents):
        raise ValueError(
            f"parents must be an integer tensor of shape ({num_nodes},) like draft_tokens, "
            f"got shape {tuple(parents.shape)} dtype {parents.dtype}"
        )
    if target_probs.dim() != 2 or target_probs.shape[0] != num_nodes or not target_probs.is_floating_point():
        raise ValueError(
            f"target_probs must be a floating tensor [N={num_nodes}, V], "
            f"got shape {tuple(target_probs.shape)} dtype {target_probs.dtype}"
        )
    vocab = target_probs.shape[1]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary dimension")
    if draft_probs is not None and (draft_probs.shape != target_probs.shape or not draft_probs.is_floating_point()):
        raise ValueError(
            f"draft_probs must be a floating tensor of target_probs' shape {tuple(target_probs.shape)}, "
            f"got shape {tuple(draft_probs.shape)} dtype {draft_probs.dtype}"
        )

    parent_list = parents.tolist()
    if parent_list[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {parent_list[0]}")
    children: list[list[int]] = [[] for _ in range(num_nodes)]
    depths = [0] * num_nodes
    for node in range(1, num_nodes):
        parent = parent_list[node]
        if not 0 <= parent < node:
            raise ValueError(f"parents must be topological (0 <= parents[i] < i for i > 0): parents[{node}] = {parent}")
        children[parent].append(node)
        depths[node] = depths[parent] + 1
    tokens = draft_tokens.tolist()
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise ValueError(f"draft_tokens must lie in [0, V={vocab}), got min {min(tokens)} max {max(tokens)}")

    if not rows:
        return _Tree(tokens=tokens, children=children, depths=depths)
    _check_rows("target_probs", target_probs, [True] * num_nodes)
    if draft_probs is not None:  # leaf rows are never used: they only need to be finite
        _check_rows("draft_probs", draft_probs, [bool(kids) for kids in children])
    return _Tree(tokens=tokens, children=children, depths=depths)


def _check_rows(name: str, probs: Tensor, needs_mass: list[bool]) -> None:
    """All entries finite and >= 0; rows flagged in needs_mass [N] have positive mass. One sync.

    Row sums catch NaN / +inf (they propagate into the sum) and the minimum catches -inf and
    negatives, so two reductions cover every check.
    """
    stats = torch.cat([probs.sum(dim=-1, dtype=torch.float64), probs.amin().reshape(1).double()])  # [N + 1]
    *row_mass, min_entry = stats.tolist()
    if not all(math.isfinite(m) for m in row_mass) or not math.isfinite(min_entry):
        raise ValueError(f"{name} contains NaN or inf")
    if min_entry < 0:
        raise ValueError(f"{name} contains negative entries (min {min_entry})")
    for node, (mass, needed) in enumerate(zip(row_mass, needs_mass)):
        if needed and not mass > 0:
            raise ValueError(f"{name}[{node}] has zero mass but a distribution is needed there")


def _not_integer(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool
