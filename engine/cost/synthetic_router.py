"""Synthetic MoE router for scaled what-if studies, calibrated on real routing statistics.

    from engine.cost.synthetic_router import SyntheticRouter, calibrate
    router = SyntheticRouter(num_experts=256, top_r=8, num_layers=58, calibration=calibrate(path), seed=0)
    routing = router.route_sequence(64)          # L x LongTensor [T, r], experts sorted by router score
    tree_routing = router.route_tree(parents)    # L x LongTensor [N, r] for a draft tree

Model. Every (token, layer) has a latent score per expert, log popularity + Gumbel noise; its top-r are
the routed experts (the Gumbel-top-k trick, Kool et al. 1903.06059: r draws without replacement). The
noise is iid Gumbel for every (token, layer, expert) marginally, so each layer's expert counts follow its
popularity exactly; correlations come only from *sharing* noise coordinates:

    cross-layer   h[t, l, i] = h[t, l-1, follow_l(i)]  with prob. q_x  else fresh
                  follow_l maps layer l's k-th most popular expert to layer l-1's k-th (a fixed random
                  permutation, since popularity orders are random per layer)
    temporal      g[t, l, i] = g[t-1, l, i]            with prob. q_t  else h[t, l, i]
    tree          g[c, l, i] = family latent of the parent (a) else h[c, l, i]; the family latent copies
                  the parent's g with prob. b else is fresh: children share a·b with the parent, a² among
                  themselves

Two cells that share each coordinate with prob. s have a top-r overlap that grows with s; the router
inverts that curve (by Monte Carlo, at construction) so that consecutive tokens share `temporal_overlap`
of their experts per layer (Mixtral decode shares 0.34–0.40, 0.25 if independent: DESIGN §2) and
children their parent's.

Calibration (`calibrate`) on ../shared/data/routing (OLMoE 2409.02060 / Mixtral routing on GitHub code):
popularity = log-normal quantiles with spread fitted per recorded layer so the Gini coefficient of the
generated per-expert counts matches the data's; q_x fitted so the rank-aligned cross-layer mutual
information (layers 0→7 and 7→15) matches. Without the data, `DEFAULT_CALIBRATIONS` holds the fit.
"""

# T=tokens N=tree nodes L=layers E=experts r=top-r S=Monte Carlo samples
from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.cost.utility import expected_distinct_experts

ROUTING_FILE = "olmoe_mixtral_github_expert_counts.json"
DATA_KEYS = {
    "olmoe": ("olmoe_expert_counts_github", 64, 8),
    "mixtral": ("mistral_expert_counts_github", 8, 2),
}
CROSSLAYER_KEY = "olmoe_expert_counts_crosslayer_github"
CROSSLAYER_PAIRS = ((0, 7), (7, 15))  # OLMoE layers of the recorded pairs (of 16); knots 0, 1, 2
CROSSLAYER_DISTANCE = 7.5  # mean layer gap of those pairs: the distance at which q_x is matched
_MC_SEED = 1234  # calibration Monte Carlo uses its own stream: constants do not depend on a router's seed


@dataclass(frozen=True)
class RouterCalibration:
    """Fitted parameters of SyntheticRouter.

    depth_knots: relative depth l/(L−1) of the recorded layers; popularity_gini: Gini coefficient of
    per-expert assignment counts there (linearly interpolated in between); crosslayer_share: probability
    that a latent coordinate follows the previous layer (per layer, at CROSSLAYER_DISTANCE); *_overlap:
    target share of top-r experts in common (None = independent / only through the parent).
    """

    source: str
    depth_knots: tuple[float, ...]
    popularity_gini: tuple[float, ...]
    crosslayer_share: float
    temporal_overlap: float | None = 0.37
    tree_parent_overlap: float | None = None  # None: same as temporal_overlap
    tree_sibling_overlap: float | None = None  # None: siblings share only through their parent
    data_crosslayer_mi: tuple[float, ...] = ()  # nats, diagnostics of the fit


# Fitted by calibrate() on ../shared/data/routing/olmoe_mixtral_github_expert_counts.json (allenai/OLMoE
# routing analysis, GitHub code domain). Mixtral has no cross-layer record: it uses OLMoE's share.
DEFAULT_CALIBRATIONS = {
    "olmoe": RouterCalibration(
        source="olmoe-1b-7b github (defaults)",
        depth_knots=(0.0, 7 / 15, 1.0),
        popularity_gini=(0.2909, 0.5835, 0.5894),
        crosslayer_share=0.9252,
        data_crosslayer_mi=(0.1168, 0.2016),
    ),
    "mixtral": RouterCalibration(
        source="mixtral-8x7b github (defaults)",
        depth_knots=(0.0, 0.5, 1.0),
        popularity_gini=(0.0551, 0.0672, 0.1035),
        crosslayer_share=0.9252,
    ),
}


def default_calibration(num_experts: int) -> RouterCalibration:
    """Stored fit of the record whose expert count is nearest on a log scale: Mixtral (8) up to 22
    experts, OLMoE (64) above. Skew does not transfer freely across expert counts: a Gini of 0.58 on 8
    experts already makes consecutive top-2 sets overlap by ~0.58."""
    return DEFAULT_CALIBRATIONS["mixtral" if num_experts <= 22 else "olmoe"]


# ---------------------------------------------------------------------- statistics
def gini(counts: torch.Tensor | Sequence[float]) -> float:
    """Gini coefficient of per-expert counts [E]: 0 = uniform, → 1 = one expert takes everything."""
    p = np.sort(np.asarray(counts, dtype=float))
    if p.sum() <= 0:
        return 0.0
    E = len(p)
    return float((2 * np.arange(1, E + 1) - E - 1).dot(p) / (E * p.sum()))


def crosslayer_mutual_information(joint: torch.Tensor | np.ndarray) -> float:
    """Mutual information (nats, Miller–Madow bias-corrected) of a [E, E] count table of expert pairs."""
    J = np.asarray(joint, dtype=float)
    n = J.sum()
    P = J / n
    pa, pb = P.sum(1), P.sum(0)
    nz = P > 0
    mi = float((P[nz] * np.log(P[nz] / np.outer(pa, pb)[nz])).sum())
    return float(mi - (nz.sum() - (pa > 0).sum() - (pb > 0).sum() + 1) / (2 * n))


def rank_aligned_joint(first: torch.Tensor, second: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, E] counts of (k-th expert of `first`, k-th of `second`) over tokens; both [T, r] sorted by score.

    This is how the OLMoE analysis pairs layers (zip of the two top-r lists)."""
    flat = first.reshape(-1).long() * num_experts + second.reshape(-1).long()
    return torch.bincount(flat, minlength=num_experts * num_experts).reshape(num_experts, num_experts)


def top_r_overlap(expert_ids: torch.Tensor) -> float:
    """Mean share of top-r experts a token has in common with the previous one; expert_ids [T, r]."""
    same = (expert_ids[1:, :, None] == expert_ids[:-1, None, :]).any(-1)  # [T-1, r]
    return float(same.float().mean())


# ---------------------------------------------------------------------- Monte Carlo inversions
def _gumbel(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    return -torch.empty(*shape).exponential_(generator=gen).clamp_min_(1e-30).log()


def _logits(sigma: float, num_experts: int) -> torch.Tensor:
    """Log popularity by popularity rank: log-normal quantiles with spread sigma, most popular first."""
    q = (torch.arange(num_experts, dtype=torch.float64) + 0.5) / num_experts
    return (-sigma * torch.special.ndtri(q)).float()


@functools.lru_cache(maxsize=256)
def _solve_sigma(target_gini: float, num_experts: int, top_r: int, samples: int = 4000) -> float:
    """Spread whose Gumbel-top-r assignment counts have the target Gini (bisection, common noise)."""
    if top_r >= num_experts or target_gini <= 0:
        return 0.0
    noise = _gumbel((samples, num_experts), torch.Generator().manual_seed(_MC_SEED))

    def count_gini(sigma: float) -> float:
        ids = (_logits(sigma, num_experts) + noise).topk(top_r, -1).indices
        return gini(torch.bincount(ids.reshape(-1), minlength=num_experts))

    lo, hi = 0.0, 6.0
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if count_gini(mid) < target_gini else (lo, mid)
    return (lo + hi) / 2


_SHARE_GRID = np.linspace(0.0, 1.0, 21)


@functools.lru_cache(maxsize=256)
def _overlap_curve(sigma: float, num_experts: int, top_r: int, samples: int = 1500) -> tuple[float, ...]:
    """Mean top-r overlap of two cells sharing each latent coordinate with prob. s, for s in _SHARE_GRID."""
    gen = torch.Generator().manual_seed(_MC_SEED)
    logits = _logits(sigma, num_experts)
    a, b = _gumbel((samples, num_experts), gen), _gumbel((samples, num_experts), gen)
    u = torch.rand(samples, num_experts, generator=gen)
    top_a = (logits + a).topk(top_r, -1).indices  # [S, r]
    shares = torch.tensor(_SHARE_GRID, dtype=torch.float32)
    c = torch.where(u[None] < shares[:, None, None], a[None], b[None])  # [grid, S, E]
    top_c = (logits + c).topk(top_r, -1).indices  # [grid, S, r]
    overlap = (top_c[..., :, None] == top_a[None, :, None, :]).any(-1).float().mean((1, 2))  # [grid]
    return tuple(torch.cummax(overlap, 0).values.tolist())  # monotone up to Monte Carlo noise


def _share_for_overlap(target: float | None, sigma: float, num_experts: int, top_r: int) -> float:
    """Coordinate-sharing probability s at which two cells' top-r sets overlap by `target` on average."""
    if target is None:
        return 0.0
    if not 0.0 < target <= 1.0:
        raise ValueError(f"overlap target must lie in (0, 1], got {target}")
    overlap = _overlap_curve(round(sigma, 6), num_experts, top_r)
    if target <= overlap[0]:
        return 0.0  # popularity alone already makes cells overlap this much
    return float(np.interp(target, overlap, _SHARE_GRID))


# ---------------------------------------------------------------------- calibration
def _find_routing_file(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    for candidate in (path, path / ROUTING_FILE, path / "routing" / ROUTING_FILE):
        if candidate.is_file():
            return candidate
    return None


def _counts(layer_map: dict[str, int], num_experts: int) -> torch.Tensor:
    return torch.tensor([float(layer_map.get(str(e), 0)) for e in range(num_experts)])


def _fit_share(pair_joint: np.ndarray, sigmas: tuple[float, float], num_experts: int, top_r: int) -> float:
    """Coordinate-sharing probability s between two layers whose rank-aligned MI equals the data's."""
    target = crosslayer_mutual_information(pair_joint)
    gen = torch.Generator().manual_seed(_MC_SEED)
    samples = 12000
    la, lb = _logits(sigmas[0], num_experts), _logits(sigmas[1], num_experts)  # rank-preserving follow map
    a, b = _gumbel((samples, num_experts), gen), _gumbel((samples, num_experts), gen)
    u = torch.rand(samples, num_experts, generator=gen)
    top_a = (la + a).topk(top_r, -1).indices

    def mi(s: float) -> float:
        top_b = (lb + torch.where(u < s, a, b)).topk(top_r, -1).indices
        return crosslayer_mutual_information(rank_aligned_joint(top_a, top_b, num_experts).numpy())

    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mi(mid) < target else (lo, mid)
    return (lo + hi) / 2


def calibrate(path: str | Path | None = None, model: str = "olmoe") -> RouterCalibration:
    """Fit RouterCalibration to the routing record under `path` (the data folder, its routing/ folder or
    the JSON file). `model` picks the per-layer popularity record: "olmoe" (64 experts, top-8) or "mixtral"
    (8, top-2); the cross-layer share is always fitted on OLMoE's record (Mixtral has none). When the
    record is absent, returns DEFAULT_CALIBRATIONS[model] (the same fit, stored)."""
    if model not in DATA_KEYS:
        raise ValueError(f"unknown routing record {model!r}; available: {', '.join(DATA_KEYS)}")
    file = _find_routing_file(path)
    if file is None:
        return DEFAULT_CALIBRATIONS[model]
    data = json.loads(file.read_text())
    key, E, r = DATA_KEYS[model]
    ginis = tuple(round(gini(_counts(m, E)), 4) for m in data[key])
    knots = DEFAULT_CALIBRATIONS[model].depth_knots
    # cross-layer: per recorded pair, the sharing probability at its distance d; then one per-layer share
    o_key, oE, o_r = DATA_KEYS["olmoe"]
    o_sigmas = [_solve_sigma(round(gini(_counts(m, oE)), 4), oE, o_r) for m in data[o_key]]
    shares, mis = [], []
    for k, m in enumerate(data[CROSSLAYER_KEY]):
        joint = np.zeros((oE, oE))
        for pair, count in m.items():
            ea, eb = (int(x) for x in pair.split("-"))
            joint[ea, eb] = count
        mis.append(round(float(crosslayer_mutual_information(joint)), 4))
        s = _fit_share(joint, (o_sigmas[k], o_sigmas[k + 1]), oE, o_r)
        shares.append((CROSSLAYER_PAIRS[k][1] - CROSSLAYER_PAIRS[k][0], max(s, 1e-6)))
    # one per-layer share for both pairs: least squares on log s_d = d·log ρ
    log_rho = sum(d * math.log(s) for d, s in shares) / sum(d * d for d, _ in shares)
    return RouterCalibration(
        source=f"{model} github ({file.name})",
        depth_knots=knots,
        popularity_gini=ginis,
        crosslayer_share=round(math.exp(log_rho), 4),
        data_crosslayer_mi=tuple(mis) if model == "olmoe" else (),
    )


# ---------------------------------------------------------------------- router
class SyntheticRouter:
    """Routing for any (experts E, top-r, layers L) following a RouterCalibration; deterministic per seed.

    Successive calls draw from one torch.Generator, so two routers with the same seed and the same calls
    return the same routing.
    """

    def __init__(
        self,
        num_experts: int,
        top_r: int,
        num_layers: int,
        calibration: RouterCalibration | None = None,
        seed: int = 0,
    ) -> None:
        if not 0 < top_r <= num_experts or num_layers < 1:
            raise ValueError(
                f"need 0 < top_r <= num_experts and num_layers >= 1, got {top_r}, {num_experts}, {num_layers}"
            )
        self.num_experts, self.top_r, self.num_layers = num_experts, top_r, num_layers
        self.calibration = cal = calibration or default_calibration(num_experts)
        self.generator = torch.Generator().manual_seed(seed)
        E, L = num_experts, num_layers
        depth = np.linspace(0.0, 1.0, L) if L > 1 else np.zeros(1)
        knot_sigma = [_solve_sigma(g, E, top_r) for g in cal.popularity_gini]
        sigma = np.interp(depth, cal.depth_knots, knot_sigma)  # [L]
        # expert order[l, k] has popularity rank k in layer l
        self.order = torch.stack([torch.randperm(E, generator=self.generator) for _ in range(L)])  # [L, E]
        self.logits = torch.empty(L, E)  # [L, E] log popularity (up to a constant)
        for l in range(L):
            self.logits[l, self.order[l]] = _logits(float(sigma[l]), E)
        self.follow = torch.empty(L, E, dtype=torch.long)  # coordinate of layer l-1 that layer l follows
        self.follow[0] = torch.arange(E)
        for l in range(1, L):
            self.follow[l, self.order[l]] = self.order[l - 1]

        # overlap -> sharing is solved at the knots and midway between them, then interpolated in depth
        points = np.unique(np.concatenate([cal.depth_knots, np.convolve(cal.depth_knots, [0.5, 0.5], "valid")]))
        point_sigma = np.interp(points, cal.depth_knots, knot_sigma)

        def per_layer(target: float | None) -> torch.Tensor:
            shares = [_share_for_overlap(target, float(s), E, top_r) for s in point_sigma]
            return torch.tensor(np.interp(depth, points, shares), dtype=torch.float32)

        self.temporal_share = per_layer(cal.temporal_overlap)  # [L] q_t
        parent_target = cal.tree_parent_overlap if cal.tree_parent_overlap is not None else cal.temporal_overlap
        parent = per_layer(parent_target)  # [L] sharing child-parent
        sibling = torch.maximum(per_layer(cal.tree_sibling_overlap), parent**2)  # [L] between siblings
        # child coordinate = family latent (prob. a) else its own; family latent = parent's (prob. b) else
        # fresh: child-parent sharing a·b, sibling sharing a², so siblings share >= parent² (via the parent)
        self.family_share = sibling.sqrt()  # [L] a
        self.family_from_parent = torch.where(self.family_share > 0, parent / self.family_share.clamp_min(1e-9), 0.0)
        # Temporal copying dilutes within-token sharing: cells of layers a and b coincide only if both
        # reach back to the same token, P = F(q_a, q_b) = (1-q_a)(1-q_b)/(1-q_a q_b). Spread -log F over the
        # layers so that sharing at CROSSLAYER_DISTANCE stays crosslayer_share ** distance.
        q = self.temporal_share.double()
        phi = torch.log((1 + q) / (1 - q).clamp_min(1e-9))  # [L] -log F(q_l, q_l)
        boost = torch.exp((phi[1:] + phi[:-1]) / (2 * CROSSLAYER_DISTANCE))  # [L-1]
        self.crosslayer_share = torch.zeros(L)  # [L] q_x (layer 0 has no previous layer)
        self.crosslayer_share[1:] = (cal.crosslayer_share * boost).clamp(max=1.0).float()

    @property
    def popularity(self) -> torch.Tensor:
        """[L, E] probability of each expert under plain (r=1) sampling."""
        return torch.softmax(self.logits, -1)

    def _within_token(self, n: int) -> torch.Tensor:
        """Latent noise h [L, n, E] with cross-layer following."""
        L, E = self.num_layers, self.num_experts
        h = _gumbel((L, n, E), self.generator)
        follow = torch.rand(L, n, E, generator=self.generator) < self.crosslayer_share[:, None, None]
        for l in range(1, L):
            h[l] = torch.where(follow[l], h[l - 1][:, self.follow[l]], h[l])
        return h

    def _top_r(self, g: torch.Tensor) -> list[torch.Tensor]:
        ids = (self.logits[:, None, :] + g).topk(self.top_r, -1).indices  # [L, n, r], best score first
        return list(ids.unbind(0))

    def route_sequence(self, num_tokens: int) -> list[torch.Tensor]:
        """Routing of consecutive tokens: one LongTensor [T, r] per layer."""
        T = num_tokens
        h = self._within_token(T)  # [L, T, E]
        copy = torch.rand(self.num_layers, T, self.num_experts, generator=self.generator)
        copy = copy < self.temporal_share[:, None, None]
        copy[:, :1] = False
        src = torch.where(copy, 0, torch.arange(T, dtype=torch.int32)[None, :, None]).numpy()
        src = np.maximum.accumulate(src, axis=1)  # last token that drew its own coordinate
        return self._top_r(h.gather(1, torch.from_numpy(src).long()))

    def route_tree(self, parents: torch.Tensor | Sequence[int]) -> list[torch.Tensor]:
        """Routing of a draft tree: parents [N] (−1 for a root, else an earlier node) -> L x [N, r].

        Each parent has a family latent that copies the parent's coordinates with prob. b and is fresh
        otherwise; each child takes a coordinate from its family latent with prob. a, else draws its own.
        So children share a·b of their coordinates with the parent and siblings a² with each other.
        """
        parents = torch.as_tensor(parents, dtype=torch.long)
        N = parents.numel()
        bad = [i for i in range(N) if not -1 <= int(parents[i]) < i]
        if bad:
            raise ValueError(f"nodes {bad} need a parent in [-1, node index): parents must come first")
        depth = torch.zeros(N, dtype=torch.long)
        for i in range(N):
            if parents[i] >= 0:
                depth[i] = depth[parents[i]] + 1
        L, E = self.num_layers, self.num_experts
        h = self._within_token(N)  # [L, N, E]
        family = _gumbel((L, N, E), self.generator)  # family latent of node j's children, [L, N, E]
        from_parent = torch.rand(L, N, E, generator=self.generator) < self.family_from_parent[:, None, None]
        from_family = torch.rand(L, N, E, generator=self.generator) < self.family_share[:, None, None]
        g = h.clone()
        for d in range(1, int(depth.max()) + 1 if N else 0):
            nodes = (depth == d).nonzero().squeeze(1)
            par = parents[nodes]
            fam = torch.where(from_parent[:, par], g[:, par], family[:, par])  # [L, n_d, E]
            g[:, nodes] = torch.where(from_family[:, nodes], fam, h[:, nodes])
        return self._top_r(g)


@dataclass(frozen=True)
class DistinctCurve:
    """Mean distinct experts per layer touched by the first t tokens, t = 1..max_tokens."""

    tokens: tuple[int, ...]
    synthetic: tuple[float, ...]
    uniform: tuple[float, ...]  # M·[1 − (1 − r/M)^t]


def distinct_by_prefix(routings: Sequence[Sequence[torch.Tensor]], num_experts: int) -> list[float]:
    """Mean distinct experts per layer touched by the first t tokens, t = 1..T, averaged over routings.

    routings: S routings, each L x expert_ids [T, r] (one chain of T tokens) -> [T] floats."""
    total = np.zeros(0)
    for rt in routings:
        ids = torch.stack(list(rt), 1)  # [T, L, r]
        seen = torch.zeros(ids.shape[0], ids.shape[1], num_experts, dtype=torch.bool)
        seen.scatter_(2, ids, True)
        curve = np.logical_or.accumulate(seen.numpy(), axis=0).sum(2).mean(1)  # [T] touched by tokens <= t
        total = curve if not total.size else total + curve
    return (total / len(routings)).tolist()


def distinct_experts_curve(router: SyntheticRouter, max_tokens: int, num_sequences: int = 4) -> DistinctCurve:
    """Footprint growth of routed sequences vs independent uniform routing."""
    routings = [router.route_sequence(max_tokens) for _ in range(num_sequences)]
    tokens = tuple(range(1, max_tokens + 1))
    return DistinctCurve(
        tokens=tokens,
        synthetic=tuple(distinct_by_prefix(routings, router.num_experts)),
        uniform=tuple(expected_distinct_experts(router.num_experts, router.top_r, t) for t in tokens),
    )


def with_overrides(calibration: RouterCalibration, **changes: float | None) -> RouterCalibration:
    """Copy of a calibration with some fields changed, e.g. temporal_overlap=None for independent tokens."""
    return dataclasses.replace(calibration, **changes)
