"""Synthetic routing keyed on a token's identity, so live runs and trace replay see the same experts.

`SyntheticRouter` draws from one running generator: the experts a token gets depend on the order of the
calls. For a what-if model spec larger than the run's target, live and replay must instead route every
verified token identically however the rounds were cut, so here a token's experts are a pure function of
its identity, the tokens of its path (prompt, committed tokens, then the tree path to the node):

    key(root of a request) = fold of mix64 over (seed, prompt tokens)      64-bit identities
    key(child)             = mix64(key(parent) + (token + 1) * GAMMA)      a node, or the next committed token
    latent g [L, E]        per coordinate (l, e), with h, w, u counter-based noise of key(node):
                             h[l, e] = h[l - 1, follow_l(e)] if w < q_x[l]   else fresh Gumbel  (cross-layer)
                             g[l, e] = parent's g[l, e]      if u < q_t[l]   else h[l, e]       (temporal / tree)
    experts                top-r of (log popularity[l] + g[l]) per layer

Popularity, the cross-layer map follow_l and the shares q_t (consecutive tokens share
`temporal_overlap` of their experts: 0.34-0.40 on Mixtral decode) and q_x are the calibrated
parameters of `SyntheticRouter` (../shared/data/routing); the chain is path-Markov: a child shares q_t
with its parent, siblings share through the parent, and a committed token is the child of the previous
one, so a node's routing equals the routing it gets once committed. Noise: SplitMix64 (as
engine.spec.gumbel), bit-identical on every machine.

Shape letters: N=nodes L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.cost.synthetic_router import RouterCalibration, SyntheticRouter

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """SplitMix64 finaliser on a Python int (mod 2**64)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _mix64_np(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (multiplication wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def child_key(parent_key: int, token: int) -> int:
    """Identity of the token `token` following the token identified by `parent_key`."""
    return mix64(parent_key + (int(token) + 1) * _GAMMA)


class NodeRouter:
    """Routing of (num_layers, num_experts, top_r) for tokens identified by their path (module docstring)."""

    def __init__(
        self,
        num_experts: int,
        top_r: int,
        num_layers: int,
        calibration: RouterCalibration | None = None,
        seed: int = 0,
    ) -> None:
        base = SyntheticRouter(num_experts, top_r, num_layers, calibration, seed)
        self.num_experts, self.top_r, self.num_layers, self.seed = num_experts, top_r, num_layers, seed
        self.log_popularity = base.logits.numpy().astype(np.float64)  # [L, E]
        self.follow = base.follow.numpy().astype(np.int64)  # [L, E]
        self.temporal_share = base.temporal_share.numpy().astype(np.float64)  # [L] q_t
        self.crosslayer_share = base.crosslayer_share.numpy().astype(np.float64)  # [L] q_x
        LE = num_layers * num_experts
        self._counters = (np.arange(1, 3 * LE + 1, dtype=np.uint64) * np.uint64(_GAMMA)).reshape(
            3, num_layers, num_experts
        )

    def sequence_key(self, tokens: Sequence[int]) -> int:
        """Identity of the last token of `tokens` (a prompt: the first round's root)."""
        key = mix64(self.seed * _GAMMA + 0x5EED)
        for t in tokens:
            key = child_key(key, t)
        return key

    def latent(self, keys: Sequence[int], parent_latent: np.ndarray | None) -> np.ndarray:
        """Latents g [N, L, E] of nodes with identities `keys` [N] whose parents have `parent_latent`
        [N, L, E] (None: no parent, e.g. a request's first root)."""
        k = np.asarray([int(x) & _M64 for x in keys], dtype=np.uint64)  # [N]
        with np.errstate(over="ignore"):
            bits = _mix64_np(k[:, None, None, None] + self._counters[None])  # [N, 3, L, E]
        unit = lambda b: ((b >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # noqa: E731 - (0, 1)
        h = -np.log(-np.log(unit(bits[:, 0])))  # fresh Gumbel noise
        follow = unit(bits[:, 2]) < self.crosslayer_share[None, :, None]
        for layer in range(1, self.num_layers):  # cross-layer following acts on the fresh noise, as in
            h[:, layer] = np.where(follow[:, layer], h[:, layer - 1][:, self.follow[layer]], h[:, layer])
        if parent_latent is None:  # SyntheticRouter; then the temporal / tree copy of the parent's latent
            return h
        copy = unit(bits[:, 1]) < self.temporal_share[None, :, None]
        return np.where(copy, parent_latent, h)

    def route(self, latent: np.ndarray) -> np.ndarray:
        """Latents [N, L, E] -> expert ids [N, L, r] int16, best router score first."""
        score = self.log_popularity[None] + latent  # [N, L, E]
        r = self.top_r
        idx = np.argpartition(-score, r - 1, axis=-1)[..., :r]
        order = np.argsort(-np.take_along_axis(score, idx, -1), axis=-1, kind="stable")
        return np.take_along_axis(idx, order, -1).astype(np.int16)

    def route_tree(
        self, root_key: int, root_latent: np.ndarray, tokens: Sequence[int], parents: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """A draft tree under a root (node 0, identity `root_key`, latent [L, E]) -> (expert ids [N, L, r],
        latents [N, L, E], keys [N]). parents: topological, parents[0] = -1."""
        N = len(tokens)
        keys = [root_key] + [0] * (N - 1)
        for i in range(1, N):
            keys[i] = child_key(keys[parents[i]], tokens[i])
        lat = np.empty((N, self.num_layers, self.num_experts))
        lat[0] = root_latent
        depth = [0] * N
        for i in range(1, N):
            depth[i] = depth[parents[i]] + 1
        max_depth = max(depth)
        par = np.asarray(parents)
        dep = np.asarray(depth)
        for d in range(1, max_depth + 1):
            nodes = np.flatnonzero(dep == d)
            lat[nodes] = self.latent([keys[j] for j in nodes], lat[par[nodes]])
        return self.route(lat), lat, keys
