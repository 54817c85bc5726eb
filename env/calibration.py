"""Calibrated draft confidence: P(a depth-d draft is accepted | its parent was, raw confidence c), from a trace.

The zoo's distilled drafter is badly calibrated (where its top-1 probability is below 0.2 the target still
accepts that token 69-86 % of the time), so the observation carries a calibrated copy of the per-depth
confidence (engine.runtime.observation, `calibration` argument of observe / Engine / both envs).

Samples: at every trace position, the W = 1 chain's depth-d node (its confidence is the round's
confidence at depth d) with label "its token is the continuation's", for the positions whose depth d - 1
node was accepted (the definition of a_d). Fit: isotonic regression (pool-adjacent-violators) of the
label on the confidence per depth (depths past `max_depth_fit` share the last fit), on the training
requests; `calibration_error` reports the expected calibration error (10 equal-width bins) of the raw and
the calibrated confidence on held-out requests.

Shape letters: S=samples D=depths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.drafting.acceptance import AGREE, DISAGREE, MAX_NGRAM, NONE, STATES, AcceptanceModel, agreement_state
from engine.drafting.suffix import SuffixIndex
from engine.spec.calibration import IsotonicCalibration
from env.trace import Trace


def chain_samples(trace: Trace, requests: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per depth d = 1..Kmax: (raw confidence [S], accepted [S] 0/1) of the W=1 chain's depth-d nodes."""
    if 1 not in trace.widths:
        raise ValueError("calibration reads the W = 1 chain: record the trace with width 1 in its grid")
    w = trace.widths.index(1)
    K = trace.kmax
    conf: list[list[float]] = [[] for _ in range(K)]
    label: list[list[int]] = [[] for _ in range(K)]
    for i in requests:
        cont = trace.continuation_of(i)
        for t, p in enumerate(trace.positions_of(i)):
            sl = trace.nodes_of(p)
            order = trace.tree_order(p, w)
            tok, cp = trace.node_token[sl], trace.node_cond_prob[sl]
            for d, j in enumerate(order[1:], start=1):
                if t + d - 1 >= len(cont):
                    break
                ok = int(tok[j]) == int(cont[t + d - 1])
                conf[d - 1].append(float(cp[j]))
                label[d - 1].append(int(ok))
                if not ok:
                    break  # deeper nodes' parents were rejected
    return [(np.asarray(c), np.asarray(y, dtype=np.float64)) for c, y in zip(conf, label)]


def _isotonic(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: knots (x, non-decreasing fitted y) of the least-squares isotonic fit."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    blocks: list[list[float]] = []  # [sum y, count, x min, x max]
    for xv, yv in zip(xs, ys):
        blocks.append([yv, 1.0, xv, xv])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            s, n, lo, hi = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
            blocks[-1][3] = hi
    knots_x, knots_y = [], []
    for s, n, lo, hi in blocks:
        knots_x += [lo, hi]
        knots_y += [s / n, s / n]
    return np.asarray(knots_x), np.asarray(knots_y)


def fit_calibration(trace: Trace, requests: list[int] | None = None, min_samples: int = 20) -> IsotonicCalibration:
    """Isotonic fit per depth on `requests` (default: all); a depth with fewer than `min_samples` samples
    reuses the previous depth's fit (or the identity at depth 1)."""
    requests = list(range(trace.num_requests)) if requests is None else requests
    return fit_calibration_many([(trace, requests)], min_samples)


def fit_calibration_many(parts: list[tuple[Trace, list[int]]], min_samples: int = 20) -> IsotonicCalibration:
    """One isotonic fit per depth over the samples of several (trace, requests) pairs (one controller for
    several workloads)."""
    per = [chain_samples(t, list(r)) for t, r in parts]
    K = min(len(p) for p in per)
    samples = [(np.concatenate([p[d][0] for p in per]), np.concatenate([p[d][1] for p in per])) for d in range(K)]
    xs, ys = [], []
    prev: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    for c, y in samples:
        if len(c) >= min_samples:
            kx, ky = _isotonic(c, y)
            prev = (tuple(kx.tolist()), tuple(ky.tolist()))
        xs.append(prev[0])
        ys.append(prev[1])
    return IsotonicCalibration(tuple(xs), tuple(ys))


def expected_calibration_error(conf: np.ndarray, label: np.ndarray, bins: int = 10) -> float:
    """Σ_b |bin| / S · |mean label − mean confidence| over equal-width confidence bins."""
    if len(conf) == 0:
        return 0.0
    idx = np.minimum((np.asarray(conf) * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            err += m.mean() * abs(label[m].mean() - conf[m].mean())
    return float(err)


def calibration_error(trace: Trace, calibration: Any, requests: list[int]) -> dict[str, float]:
    """ECE of the raw and of the calibrated confidence over every depth's samples of `requests` (held out)."""
    raw, cal, lab = [], [], []
    for d, (c, y) in enumerate(chain_samples(trace, requests), start=1):
        raw.append(c)
        cal.append(np.asarray([calibration(float(x), d) for x in c]))
        lab.append(y)
    raw_c, cal_c, y_all = np.concatenate(raw), np.concatenate(cal), np.concatenate(lab)
    return {
        "samples": int(len(y_all)),
        "accept_rate": float(y_all.mean()) if len(y_all) else 0.0,
        "ece_raw": expected_calibration_error(raw_c, y_all),
        "ece_calibrated": expected_calibration_error(cal_c, y_all),
    }


# ---------------------------------------------------------------------------------------------- node acceptance
def node_samples(trace: Trace, requests: list[int], max_ngram: int = MAX_NGRAM) -> dict[str, np.ndarray]:
    """Every recorded union-tree node whose parent is on the continuation's path: its agreement state with the
    prompt-lookup continuation (engine.drafting.acceptance), depth, stored conditional probability, and label
    "its token is the continuation's" -> arrays state, depth, cond, label [S]."""
    state, depth, cond, label = [], [], [], []
    for i in requests:
        prompt, cont = trace.prompt(i).tolist(), trace.continuation_of(i).tolist()
        for t, p in enumerate(trace.positions_of(i)):
            sl = trace.nodes_of(p)
            tok, par = trace.node_token[sl].tolist(), trace.node_parent[sl].tolist()
            dep, cp = trace.node_depth[sl].tolist(), trace.node_cond_prob[sl].tolist()
            index = SuffixIndex(prompt + cont[:t])
            paths: list[list[int] | None] = [[]]  # path tokens of on-path nodes (None: off the path)
            for j in range(1, len(tok)):
                base = paths[par[j]]
                d = dep[j]
                if base is None or t + d - 1 >= len(cont):
                    paths.append(None)
                    continue
                ok = tok[j] == cont[t + d - 1]
                state.append(agreement_state(index.next_token(base, max_ngram), tok[j]))
                depth.append(d)
                cond.append(cp[j])
                label.append(float(ok))
                paths.append(base + [tok[j]] if ok else None)
    return {
        "state": np.asarray(state, dtype=np.int64),
        "depth": np.asarray(depth, dtype=np.int64),
        "cond": np.asarray(cond, dtype=np.float64),
        "label": np.asarray(label, dtype=np.float64),
    }


def fit_acceptance(parts: list[tuple[Trace, list[int]]], min_samples: int = 20) -> AcceptanceModel:
    """The calibrated rule's AcceptanceModel: per agreement state, one isotonic fit of the label on the
    conditional draft probability per depth, over the training requests of several traces. A (state, depth)
    with fewer than `min_samples` samples reuses the previous depth's fit (at depth 1: the state's pooled fit
    over all depths, else the identity)."""
    samples = [node_samples(t, list(r)) for t, r in parts]
    s = {k: np.concatenate([x[k] for x in samples]) for k in ("state", "depth", "cond", "label")}
    K = max((t.kmax for t, _ in parts), default=1)
    maps = []
    for state in (NONE, AGREE, DISAGREE):
        at = s["state"] == state
        pooled: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        if at.sum() >= min_samples:
            kx, ky = _isotonic(s["cond"][at], s["label"][at])
            pooled = (tuple(kx.tolist()), tuple(ky.tolist()))
        xs, ys, prev = [], [], pooled
        for d in range(1, K + 1):
            m = at & (s["depth"] == d)
            if m.sum() >= min_samples:
                kx, ky = _isotonic(s["cond"][m], s["label"][m])
                prev = (tuple(kx.tolist()), tuple(ky.tolist()))
            xs.append(prev[0])
            ys.append(prev[1])
        maps.append(IsotonicCalibration(tuple(xs), tuple(ys)))
    return AcceptanceModel((maps[0], maps[1], maps[2]))


def acceptance_error(trace: Trace, model: AcceptanceModel, requests: list[int]) -> dict[str, Any]:
    """Held-out check of an AcceptanceModel: ECE and Brier score of P(accepted | parent accepted) from the raw
    conditional probability and from the model, share of samples per agreement state and their acceptance."""
    s = node_samples(trace, requests, model.max_ngram)
    y = s["label"]
    pred = np.asarray([model(c, d, st) for c, d, st in zip(s["cond"], s["depth"], s["state"])])
    out: dict[str, Any] = {
        "samples": int(len(y)),
        "ece_raw": expected_calibration_error(s["cond"], y),
        "ece_model": expected_calibration_error(pred, y),
        "brier_raw": float(np.mean((s["cond"] - y) ** 2)) if len(y) else 0.0,
        "brier_model": float(np.mean((pred - y) ** 2)) if len(y) else 0.0,
    }
    for state, name in zip((NONE, AGREE, DISAGREE), STATES):
        m = s["state"] == state
        out[f"share_{name}"] = float(m.mean()) if len(y) else 0.0
        out[f"accept_{name}"] = float(y[m].mean()) if m.any() else 0.0
    return out
