"""The measured cost model: a linear fit of verification seconds to (tokens, active experts, context).

seconds = fixed + per_token·n + per_active_expert·Σ_l U_l + per_layer_context·L·context
          + per_query_context·n·L·context,
fitted by least squares on measured forwards (`python -m engine.bench cost`); `fit_two_regimes` fits the single-token
decode path and the n >= 2 verification path separately (`DecodeVerifyCost`), since they run different code.
The last term is attention's work, each of the n queries reading the context's keys and values in every layer: once
the matmuls got cheap (strip-packed weights, issue 12) it decides the fit at n >= 16 (held-out R² 0.88 without it).

Shape letters: n=verified tokens L=MoE layers r=top-r.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace

import numpy as np
import torch


@dataclass(frozen=True)
class CostSample:
    """One measured forward: its routing (L x [n, r]), the context length, and wall-clock seconds."""

    routing: Sequence[torch.Tensor]
    context_len: int
    seconds: float


def cost_features(routing: Sequence[torch.Tensor], context_len: int) -> tuple[float, float, float, float, float]:
    """(1, n tokens, Σ_l distinct experts U_l, L·context, n·L·context) — the regressors of FittedCost."""
    n = float(routing[0].shape[0]) if len(routing) else 0.0
    active = float(sum(int(torch.unique(e).numel()) for e in routing))
    lc = float(len(routing) * context_len)
    return 1.0, n, active, lc, n * lc


CONSTANTS = ("fixed", "per_token", "per_active_expert", "per_layer_context", "per_query_context")


@dataclass(frozen=True)
class FittedCost:
    """seconds ≈ fixed + per_token·n + per_active_expert·Σ_l U_l + per_layer_context·L·context
    + per_query_context·n·L·context.

    `fitted` names the constants the data could identify; the others were held at 0 (their regressor did not vary
    over the samples, or is a combination of the kept ones: n·L·context when every sample has the same n).
    """

    fixed: float
    per_token: float
    per_active_expert: float
    per_layer_context: float
    per_query_context: float = 0.0
    fitted: tuple[str, ...] = CONSTANTS

    def seconds(self, n: int, distinct_total: float, layers: int, context_len: int) -> float:
        """The model at n verified tokens, Σ_l U_l = distinct_total, `layers` MoE layers and the context length."""
        lc = layers * context_len
        return (self.fixed + self.per_token * n + self.per_active_expert * distinct_total
                + self.per_layer_context * lc + self.per_query_context * n * lc)  # fmt: skip

    def predict(self, routing: Sequence[torch.Tensor], context_len: int) -> float:
        _, n, active, _, _ = cost_features(routing, context_len)
        return self.seconds(n, active, len(routing), context_len)

    __call__ = predict


def r_squared(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Coefficient of determination of `predicted` vs `measured` (1.0 when both are constant and equal)."""
    y, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    ss_res, ss_tot = float(((y - p) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    if ss_tot == 0.0:
        return 1.0 if ss_res <= 1e-24 else 0.0
    return 1.0 - ss_res / ss_tot


def identifiable_columns(X: np.ndarray) -> list[int]:
    """Columns of X [S, C] a least-squares fit can tell apart: column 0 (the constant), then each column the kept
    ones do not already span (a regressor constant over the samples, or a combination of the kept ones, is not)."""
    scaled = X / np.maximum(np.abs(X).max(axis=0), 1e-300)  # rank on comparable columns
    keep = [0]
    for j in range(1, X.shape[1]):
        if np.linalg.matrix_rank(scaled[:, keep + [j]], tol=1e-9) > len(keep):
            keep.append(j)
    return keep


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray, keep: Sequence[int]) -> dict[int, float]:
    """Least squares of y [S] on the columns `keep` of X [S, C] with every constant >= 0 (NNLS): more tokens,
    experts or context never make a forward cheaper, and an unconstrained fit to a few noisy timings (a loaded
    machine, a short trace) can price a verification below zero. The NNLS optimum is the unconstrained fit on its
    own support, so for these few columns (<= 7) every subset is solved and the best fit with no negative constant kept.
    Returns {column: constant} of the columns fitted (the others are held at 0)."""
    cols = list(keep)
    coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
    if coef.min() >= 0:  # the usual case: one solve
        return {j: float(c) for j, c in zip(cols, coef)}
    best, best_res = {cols[0]: 0.0}, float(np.sum(y**2))
    for mask in range(1, 1 << len(cols)):
        sub = [j for b, j in enumerate(cols) if mask >> b & 1]
        c, *_ = np.linalg.lstsq(X[:, sub], y, rcond=None)
        if c.min() >= 0:
            res = float(np.sum((X[:, sub] @ c - y) ** 2))
            if res < best_res:
                best, best_res = {j: float(v) for j, v in zip(sub, c)}, res
    return best


def fit_cost_model(samples: Sequence[CostSample]) -> tuple[FittedCost, float]:
    """Least-squares fit of FittedCost to measured samples, every constant >= 0 (`nonnegative_lstsq`); returns
    (model, R² on the samples).

    A regressor that is constant over the samples (say every sample has the same context) cannot be told
    apart from `fixed`; its constant is held at 0 and left out of `fitted`, as is one the sign constraint holds at 0.
    """
    if not samples:
        raise ValueError("fit_cost_model needs at least one sample")
    return _fit_features(*_features(samples))


def _features(samples: Sequence[CostSample]) -> tuple[np.ndarray, np.ndarray]:
    """(X [S, 5] the regressors `cost_features`, y [S] seconds) of samples."""
    X = np.array([cost_features(s.routing, s.context_len) for s in samples])
    return X, np.array([s.seconds for s in samples])


def _fit_features(X: np.ndarray, y: np.ndarray) -> tuple[FittedCost, float]:
    """`fit_cost_model` on regressors X [S, 5] and seconds y [S]."""
    keep = identifiable_columns(X)
    if len(y) < len(keep):
        raise ValueError(f"{len(y)} samples cannot identify {len(keep)} constants {[CONSTANTS[j] for j in keep]}")
    fitted = nonnegative_lstsq(X, y, keep)
    values = [fitted.get(j, 0.0) for j in range(X.shape[1])]
    model = FittedCost(*values, fitted=tuple(CONSTANTS[j] for j in sorted(fitted)))
    return model, r_squared(X @ np.array(values), y)


def fit_cost_model_robust(samples: Sequence[CostSample], spread: float = 5.0) -> tuple[FittedCost, float]:
    """`fit_cost_model` whose slopes timing spikes do not set: (model, R² of the refit on the samples kept).

    On a shared machine a few forwards take several times their usual seconds (another process, the allocator);
    when such spikes cluster where a regressor is large (late in a request: a long context) a least-squares fit
    reads them as that regressor's cost and prices every long-context step dearer. So: fit, drop the samples whose
    residual lies more than `spread` robust standard deviations (1.4826 · MAD) from the median residual, refit
    them, then raise or lower `fixed` by the mean residual of *all* samples, so the model's mean over the samples
    stays the measured mean: the spikes are charged to every step alike, as the overhead they are, not to context.
    (`fixed` stays >= 0.)"""
    if not samples:
        raise ValueError("fit_cost_model_robust needs at least one sample")
    X, y = _features(samples)  # [S, 5], [S]: computed once for both fits
    model, r2 = _fit_features(X, y)
    coef = lambda m: np.array([getattr(m, k) for k in CONSTANTS])  # noqa: E731
    res = y - X @ coef(model)
    med = float(np.median(res))
    mad = 1.4826 * float(np.median(np.abs(res - med)))
    kept = np.abs(res - med) <= spread * mad if mad > 0 else np.ones(len(y), dtype=bool)
    if kept.all() or int(kept.sum()) < len(identifiable_columns(X)):
        return model, r2
    core, r2 = _fit_features(X[kept], y[kept])
    shift = float(np.mean(y - X @ coef(core)))
    return dataclass_replace(core, fixed=max(core.fixed + shift, 0.0)), r2


@dataclass(frozen=True)
class DecodeVerifyCost:
    """Two FittedCost regimes: n = 1 (the engine's single-token decode path: no mask, a per-token expert
    loop) and n >= 2 (tree verification). Callable like FittedCost: (routing L x [n, r], context) -> s."""

    decode: FittedCost
    verify: FittedCost

    def __call__(self, routing: Sequence[torch.Tensor], context_len: int) -> float:
        n = int(routing[0].shape[0]) if len(routing) else 0
        return (self.decode if n <= 1 else self.verify)(routing, context_len)


def fit_two_regimes(samples: Sequence[CostSample]) -> DecodeVerifyCost:
    """fit_cost_model on the n >= 2 samples and on the n = 1 samples (the verify fit where they are too
    few to identify their constants)."""
    n_of = lambda s: int(s.routing[0].shape[0]) if len(s.routing) else 0
    verify, _ = fit_cost_model([s for s in samples if n_of(s) > 1])
    try:
        decode, _ = fit_cost_model([s for s in samples if n_of(s) <= 1])
    except ValueError:
        decode = verify
    return DecodeVerifyCost(decode, verify)


def _constants(m: FittedCost) -> dict[str, float]:
    return {k: getattr(m, k) for k in CONSTANTS}
