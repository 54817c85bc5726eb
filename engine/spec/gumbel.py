"""Drafter-invariant seeded sampling: Gumbel-max with public noise keyed on (seed, position) (DESIGN.md §3).

The token committed at absolute sequence position p (prompt tokens count, the first new token of a
prompt of length P sits at p = P) is

    y_p = argmax_v ( log target_probs_p(v) + g_p(v) ),     g_p = position_gumbel(seed, p, V)

with `target_probs_p` the *processed* target distribution (`engine.spec.sampling.process_logits`:
temperature, top-k, top-p). By the Gumbel-max trick y_p is an exact sample of target_probs_p, and
g_p depends on (seed, p) only: not on a generator's running state, the batch, the round structure or
the drafter. So the committed text is a function of (prompt, seed, target) alone and is the same for
every K, W, λ, drafter and batch composition (Daliri, Musco & Suresh 2408.07978).

The drafter proposes with the same public noise: at a node whose children sit at position p, the
children are the top-W tokens of (log draft_probs(v) + g_p(v)) (`gumbel_top_w`; W = 1 is the
Gumbel-max sample of the drafter, whose chance of equalling y_p is >= (1 - TV) / (1 + TV)).
Verification (`verify_gumbel`) computes y at each node from the target and g and descends while y is
a child: exact by construction, whatever the children are.
Which nodes a bounded frontier or max_verify keeps is then ranked by `coupled_probs`, not by q.

List sampling for trees. Gumbel-max list sampling (GLS, Rowan, Phan & Khisti 2506.05632) draws the W
children from W independent noise lists S^(k) ~ Exp(1)^V, child k = argmin_v S^(k)_v / q_v, and the
target from their minimum. Its target noise therefore depends on W (and, in its multi-draft algorithm,
on which drafts are still alive), which breaks the invariance above; it can be made W-free by splitting
one public Exp(1) vector E_p into W lists conditionally (min at a uniform list, the others min +
Exp(1)), but then it still loses to plain shared-noise top-W: on V = 50 pairs (Dirichlet mixtures;
Zipf with perturbed logits) at W = 2/3/4/8 shared top-W matched the target 0.83/0.93/0.97/1.00 and
0.69/0.79/0.85/0.95 vs GLS 0.74/0.82/0.86/0.94 and 0.63/0.70/0.75/0.85 (GLS also repeats children:
3.3 distinct of W = 4). Both are identical at W = 1. We therefore implement shared-noise top-W, which
is also Gumbel-top-k sampling without replacement from the drafter (Kool et al. 1903.06059).

Noise (`position_gumbel`): two nested SplitMix64 streams (Steele, Lea & Flood 2014), in int64
arithmetic that wraps mod 2**64 the same on every device:

    key(seed, p)   = mix64( mix64(seed) + (p + 1) * GAMMA )       one key per (seed, position)
    bits(seed,p,v) = mix64( key + (v + 1) * GAMMA ) >>> 12        52 random bits per token v
    u = (bits + 1/2) / 2**52  in [2**-53, 1 - 2**-53]            float64, never 0 or 1
    g = -log(-log(u))         in [-3.6, 36.8]                      finite: no inf ever reaches argmax

mix64 is SplitMix64's finaliser (Stafford's variant 13), GAMMA = 0x9E3779B97F4A7C15. The uniforms are
bit-identical on every device; g can differ by one ulp across devices (libm vs CUDA log).

Shape letters: N=tree nodes (root included) or rows  D=depth levels  V=vocab  W=width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.spec.sampling import row_argmax
from engine.spec.verify import VerifyResult, _check_inputs, _first_match, _result

__all__ = [
    "coupled_probs",
    "gumbel_argmax",
    "gumbel_top_w",
    "position_gumbel",
    "position_gumbel_many",
    "verify_gumbel",
]

_U64 = 2**64
_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, SplitMix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_BITS = 52  # uniform resolution: (bits + 1/2) / 2**52 is exact in float64 and lies strictly inside (0, 1)
COUPLING_SHARPNESS = 2.0  # `coupled_probs`: tuned on the zoo pair (its docstring)


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bit pattern."""
    return value - _U64 if value >= 2**63 else value


def _shr(z: Tensor, shift: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: mask the sign copies off)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """SplitMix64 finaliser on int64 bit patterns; int64 * and + wrap mod 2**64 on CPU and CUDA."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def _bits_to_gumbel(bits: Tensor) -> Tensor:
    """52-bit integers [..] (int64) -> float64 Gumbel(0, 1) noise, finite by construction."""
    u = (bits.double() + 0.5) * 2.0**-_BITS  # [2**-53, 1 - 2**-53]: both ends exact in float64
    return u.log_().neg_().log_().neg_()  # -log(-log u); -log u >= 1.1e-16 > 0, so no inf


def _as_int_list(name: str, values: int | Sequence[int] | Tensor) -> list[int]:
    if isinstance(values, Tensor):
        if values.dim() > 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"{name} must be an int or a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        return [int(v) for v in values.reshape(-1).tolist()]
    if isinstance(values, int) and not isinstance(values, bool):
        return [values]
    items = list(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ValueError(f"{name} must hold ints, got {items!r}")
    return items


def position_gumbel_many(
    seeds: int | Sequence[int] | Tensor,
    positions: int | Sequence[int] | Tensor,
    vocab_size: int,
    device: str | torch.device = "cpu",
) -> Tensor:
    """Public noise for many (seed, position) pairs at once -> float64 [N, V].

    seeds, positions: ints or 1-D integer sequences / tensors; a length-1 side broadcasts to the other's
    length N. Row i depends only on (seeds[i], positions[i]) (see the module docstring for the mixing):
    the same values whatever the other rows, their order or the device. Seeds are taken mod 2**64 like
    `engine.spec.sampling.make_generator`. Raises ValueError for a negative seed or position, mismatched
    lengths or vocab_size < 1.
    """
    seed_list = _as_int_list("seeds", seeds)
    position_list = _as_int_list("positions", positions)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if len(seed_list) == 1 and len(position_list) != 1:
        seed_list = seed_list * len(position_list)
    if len(position_list) == 1 and len(seed_list) != 1:
        position_list = position_list * len(seed_list)
    if len(seed_list) != len(position_list):
        raise ValueError(f"seeds ({len(seed_list)}) and positions ({len(position_list)}) must have equal lengths")
    if any(s < 0 for s in seed_list):
        raise ValueError(f"seeds must be >= 0, got {min(seed_list)}")
    if any(p < 0 for p in position_list):
        raise ValueError(f"positions must be >= 0, got {min(position_list)}")
    if len(position_list) and max(position_list) >= 2**62:
        raise ValueError(f"positions must be < 2**62, got {max(position_list)}")

    seed_t = torch.tensor([_signed(s % _U64) for s in seed_list], dtype=torch.int64, device=device)  # [N]
    position_t = torch.tensor(position_list, dtype=torch.int64, device=device)  # [N]
    return _bits_to_gumbel(_position_bits(seed_t, position_t, vocab_size))


def _position_bits(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """seeds [N] (int64 bit patterns), positions [N] -> the 52 random bits per token, int64 [N, V]."""
    gamma = _signed(_GAMMA)
    keys = _mix64(_mix64(seeds) + (positions + 1) * gamma)  # [N]
    counters = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * gamma  # [V]
    return _shr(_mix64(keys.unsqueeze(1) + counters), 64 - _BITS)  # [N, V]


def position_gumbel(seed: int, position: int, vocab_size: int, device: str | torch.device = "cpu") -> Tensor:
    """The public noise g_position for one request -> float64 [V] (`position_gumbel_many`'s row)."""
    for name, value in (("seed", seed), ("position", position)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    return position_gumbel_many([seed], [position], vocab_size, device)[0]


def _check_pair(logprobs: Tensor, noise: Tensor) -> None:
    if logprobs.dim() != 2 or not logprobs.is_floating_point() or logprobs.shape[1] == 0:
        raise ValueError(f"logprobs must be a floating tensor [N, V], got {logprobs.dtype} {tuple(logprobs.shape)}")
    if noise.shape != logprobs.shape or not noise.is_floating_point():
        raise ValueError(
            f"noise must be a floating tensor of logprobs' shape {tuple(logprobs.shape)}, "
            f"got {noise.dtype} {tuple(noise.shape)}"
        )


def gumbel_argmax(logprobs: Tensor, noise: Tensor) -> Tensor:
    """argmax_v (logprobs + noise) per row -> LongTensor [N]; the Gumbel-max sample of each row.

    logprobs: [N, V] log of (processed) probabilities, any float dtype; -inf marks excluded tokens.
    noise:    [N, V] Gumbel noise (`position_gumbel_many`). The sum is taken in float64.
    """
    _check_pair(logprobs, noise)
    perturbed = logprobs.double() + noise.double()
    if perturbed.device.type == "cpu":  # row_argmax's numpy path: torch's CPU argmax is ~10x slower over these rows
        return torch.tensor(row_argmax(perturbed), dtype=torch.long)
    return perturbed.argmax(dim=-1)


def gumbel_top_w(logprobs: Tensor, noise: Tensor, width: int) -> Tensor:
    """Draft children under the public noise: the top-`width` of (logprobs + noise) per row -> [N, W].

    Columns in descending perturbed order; column 0 is `gumbel_argmax`. With the drafter's processed
    log-probabilities this is Gumbel-top-k, a sample without replacement from the drafter (1903.06059),
    coupled to the target's y through the shared noise (module docstring).
    """
    _check_pair(logprobs, noise)
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= logprobs.shape[1]:
        raise ValueError(f"width must be an int in 1..V={logprobs.shape[1]}, got {width!r}")
    return torch.topk(logprobs.double() + noise.double(), width, dim=-1, sorted=True).indices


def coupled_probs(logprobs: Tensor, noise: Tensor, sharpness: float = COUPLING_SHARPNESS) -> Tensor:
    """How likely each token is to be the target's choice under the shared noise -> float64 [N, V].

    softmax(sharpness * (logprobs + noise)) per row: the chance that token v stays the maximum when the
    drafter's perturbed scores are shaken by independent Gumbel noise of scale 1 / sharpness, a stand-in
    for the unknown mismatch log target_probs - log draft_probs. Used in place of the drafter's q when
    ranking draft nodes in position mode (path products, bounded frontier, max_verify): siblings keep
    their Gumbel order at any sharpness, and the sharpness sets how a sibling weighs against a deeper
    rank-0 node. Ranking by q ignores the noise and prunes the coupled path: on the zoo pair (tiny-dense,
    T = 0.7, K = 8, W = 3, 6 prompts x 48 tokens) mean committed per round was 2.62 by q, 4.88 with
    sharpness 1, 5.54 with 2, 5.43 with 4 (chain K = 8: 3.84); the EAGLE head and T = 1 agree.
    """
    _check_pair(logprobs, noise)
    return torch.softmax(sharpness * (logprobs.double() + noise.double()), dim=-1)


def verify_gumbel(draft_tokens: Tensor, parents: Tensor, target_probs: Tensor, noise: Tensor) -> VerifyResult:
    """Walk the draft tree with the target's Gumbel-max choice y at each node (module docstring).

    draft_tokens: LongTensor [N]; draft_tokens[0] is the root (last committed token).
    parents:      LongTensor [N]; parents[0] = -1, 0 <= parents[i] < i for i > 0.
    target_probs: FloatTensor [N, V]; processed target distribution after each node (as for
                  `engine.spec.verify.verify_tree`; greedy one-hots work too: y is then the argmax).
    noise:        float [D, V], D > max depth; row d = g at the position of the depth-(d + 1) tokens,
                  i.e. position_gumbel_many(seed, first_position + arange(D), V).

    At node i (depth d) y_i = argmax(log target_probs[i] + noise[d]). *Accepted*: the walk descends to
    the child whose token is y_i. *Recovered*: y_i at the first node where no child matches (the
    rejection depth is d + 1). *Bonus*: y at the leaf a fully accepted path ends on (N = 1: the root).
    Committed = accepted tokens + that last y, which is exactly the sequence y_p position by position:
    the tree only decides how many of them one target forward yields. No generator is consumed
    (uniforms_drawn = 0). Inputs are validated as in verify_tree (ValueError).
    """
    tree = _check_inputs(draft_tokens, parents, target_probs, None)
    max_depth = max(tree.depths)
    if noise.dim() != 2 or noise.shape[0] <= max_depth or noise.shape[1] != target_probs.shape[1]:
        raise ValueError(
            f"noise must be [D > max depth {max_depth}, V={target_probs.shape[1]}], got {tuple(noise.shape)}"
        )
    depths = torch.tensor(tree.depths, device=noise.device)  # [N]
    target_choice = gumbel_argmax(target_probs.double().log(), noise[depths]).tolist()  # [N], one sync

    accepted: list[int] = []
    children_tried: list[int] = []
    node = 0
    while True:
        token = target_choice[node]
        kids = tree.children[node]
        if not kids:
            return _result(tree, accepted, token, None, children_tried, 0, 0)  # bonus
        tried, match = _first_match(tree, kids, token)
        children_tried.append(tried)
        if match is None:
            return _result(tree, accepted, token, tree.depths[node] + 1, children_tried, 0, 0)  # recovered
        accepted.append(match)
        node = match
