"""Recorded traces: what replay needs to re-run any policy exactly, in a versioned on-disk format.

For greedy decoding, and for drafter-invariant seeded sampling (`SamplingParams(mode="position")`,
2408.07978), the committed text does not depend on the policy. A trace therefore holds, per request,
the target's continuation and, at every position of it, the draft trees every action of the grid
would draft, with what pricing and replay need (DESIGN.md §3):

    position t of request i   committed = prompt + continuation[:t]; root = its last token
     └── union tree           ∪_W tree(Kmax, W): the tree growth (engine.drafting.tree_growth) with
                              deterministic children is depth by depth, so tree(K, W) is the depth-K
                              prefix of tree(Kmax, W); with a bounded frontier tree(K, W) is not a
                              subtree of tree(K, W') for W < W', hence the union over the grid's W
          node j              token, parent (local index, root -1), depth, path probability,
                              member bits (bit w: node of tree(Kmax, widths[w])),
                              target routing [L, r] from ONE tree-attention verification of the union
                              (a node's routing depends on its path only, never on its siblings),
                              predicted experts [L, E] (bit-packed) where the drafter has a predictor
     └── tree order           each tree(Kmax, W)'s nodes in the drafter's own order (ties in selection
                              break by that order, so replay selects exactly as the drafter would)
     └── confidence [nW, Kmax] growth confidence of tree(Kmax, W) per depth (RoundStats.draft_confidence)
     └── seconds               measured union verification and batched drafting, and the drafter's probe
                              (`probe`: the round's confidence before the choice; NGramDrafter) of tree(Kmax, Wmax)

plus calibration samples (measured target forwards of prefix-closed subsets and drafting rounds of
random (K, W)) from which `engine.cost.fitted` / `engine.cost.drafter_cost` fit the measured cost, and the
timed live rounds of the engine (env.host_calibration), from which `engine.cost.host_cost` fits T_book and
the fitted cost prices single-token forwards and drafting (version 2).

File: one `.npz` per workload (numpy arrays below + `meta`, a JSON document: format version, target
and drafter digests, drafter name, sampling, grid, workload), written atomically (temporary file in the
same folder, then os.replace). Loading a file of another format version, or checking it against another
model digest, raises TraceError naming the fix.

Shape letters: R=requests P=positions (all requests) M=nodes (all positions) L=MoE layers r=top-r
E=experts nW=grid widths S=calibration samples H=timed live rounds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 11  # 2: the timed live rounds (cal_live_*); 3: the drafter's probe timed per position;
# 4: the timed live one-token rounds record no routing (Engine plain_routing); 5: the timed probe finds the lookup
# match's source too (NGramDrafter.probed_source); 6: ... in the same C++ call as the match (kernels.lookup);
# 7: the probe timed in place too, before the live K = 0 rounds (cal_live_probe_seconds); 8: a drafter without a
# probe has the context probe timed (engine.runtime.context_probe); 9: a learned controller's choice timed in place
# after that probe (cal_live_policy_seconds); 10: each timed live round's run and index in its request (cal_live_run,
# cal_live_round: the warm-up surcharge, engine.cost.warmup); 11: a last live run of K = 0 without the stand-in's probe
# and choice (env.host_calibration)
FORMAT_NAME = "expertspec-trace"

# array name -> (dtype, per-what); the whole schema, checked on load
ARRAYS: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("int32", "flat prompts, request-major"),
    "prompt_offsets": ("int64", "[R + 1]"),
    "continuation": ("int32", "flat continuations (new tokens), request-major"),
    "cont_offsets": ("int64", "[R + 1]"),
    "finish_eos": ("bool", "[R] the continuation ends with EOS (else the token budget)"),
    "request_seed": ("int64", "[R] noise seed of the request (position mode; -1 greedy)"),
    "node_offsets": ("int64", "[P + 1] node range of each position; positions are request-major"),
    "tree_offsets": ("int64", "[P * nW + 1] range of tree(Kmax, widths[w]) of position p in tree_nodes (row p*nW+w)"),
    "tree_nodes": ("int16", "local node indices of each tree in the drafter's own order (root first)"),
    "confidence": ("float32", "[P, nW, Kmax] growth confidence of tree(Kmax, W) per depth (0 = not drafted)"),
    "target_seconds": ("float32", "[P] measured verification of the union tree"),
    "draft_seconds": ("float32", "[P] measured batched drafting of the grid's trees"),
    "probe_seconds": ("float32", "[P] measured probe (the drafter's or the context probe) before a choice (0: none)"),
    "node_token": ("int32", "[M]"),
    "node_parent": ("int16", "[M] local index within the position, -1 for the root"),
    "node_depth": ("int8", "[M]"),
    "node_path_prob": ("float32", "[M] drafter path probability (root 1; position mode: coupled score)"),
    "node_cond_prob": ("float32", "[M] path_prob / parent's path_prob (the growth's per-node score)"),
    "node_wmask": ("uint16", "[M] bit w: node of tree(Kmax, widths[w])"),
    "node_routing": ("int16", "[M, L, r] target expert ids"),
    "node_predicted": ("uint8", "[M, ceil(L*E/8)] packed predicted experts (empty rows: no predictor)"),
    "cal_target_position": ("int32", "[S] position of a measured target forward"),
    "cal_target_offsets": ("int64", "[S + 1]"),
    "cal_target_nodes": ("int16", "local node indices of each measured subset (root first)"),
    "cal_target_seconds": ("float32", "[S]"),
    "cal_draft_position": ("int32", "[S'] position of a measured drafting round"),
    "cal_draft_depth": ("int8", "[S']"),
    "cal_draft_width": ("int8", "[S']"),
    "cal_draft_aware": ("bool", "[S'] expert-aware (λ > 0) round"),
    "cal_draft_seconds": ("float32", "[S']"),
    "cal_live_verified": ("int16", "[H] tokens a timed live round of the engine verified (1: root only)"),
    "cal_live_plain": ("bool", "[H] the round ran on a target-only engine (no drafter)"),
    "cal_live_context": ("int32", "[H] tokens in the target's cache before it (RoundStats.context_len)"),
    "cal_live_draft_steps": ("int8", "[H] drafter forwards (env.costs.drafter_steps), 0 when nothing drafted"),
    "cal_live_rule": ("int8", "[H] what scored its nodes as they grew: an index of drafter_cost.DRAFT_RULES"),
    "cal_live_width": ("int8", "[H] W"),
    "cal_live_draft_seconds": ("float32", "[H] its drafting"),
    "cal_live_forward_seconds": ("float32", "[H] its target forward"),
    "cal_live_host_seconds": ("float32", "[H] its host work (RoundStats.host_seconds)"),
    "cal_live_probe_seconds": ("float32", "[H] the drafter's probe before it, as a probing policy runs it (0: none)"),
    "cal_live_policy_seconds": ("float32", "[H] a learned controller's choice before it (a stand-in; 0: none)"),
    "cal_live_run": ("int16", "[H] the engine and action it ran with (0: target-only, 1 + its host action's index)"),
    "cal_live_round": ("int16", "[H] its index in its request (0: the first round after the prefill)"),
}


class TraceError(ValueError):
    """A trace that cannot be used here: other format version, other model, corrupt file."""


@dataclass
class Trace:
    """A loaded trace: `meta` (JSON) + the arrays of ARRAYS as attributes (see the module docstring)."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: Path | None = None

    def __getattr__(self, name: str) -> np.ndarray:
        arrays = self.__dict__.get("arrays")
        if arrays is not None and name in arrays:
            return arrays[name]
        raise AttributeError(name)

    # ------------------------------------------------------------------ sizes
    @property
    def num_requests(self) -> int:
        return len(self.arrays["prompt_offsets"]) - 1

    @property
    def num_positions(self) -> int:
        return len(self.arrays["node_offsets"]) - 1

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(self.meta["grid"]["widths"])

    @property
    def kmax(self) -> int:
        return int(self.meta["grid"]["kmax"])

    @property
    def num_moe_layers(self) -> int:
        return int(self.meta["target"]["num_moe_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["target"]["num_experts"])

    @property
    def top_r(self) -> int:
        return int(self.meta["target"]["top_r"])

    @property
    def has_predictions(self) -> bool:
        return self.arrays["node_predicted"].shape[1] > 0

    @property
    def digest(self) -> str:
        """Content digest (16 hex digits) of meta + arrays; names caches derived from this trace."""
        return self.meta["content_digest"]

    # ------------------------------------------------------------------ views
    def prompt(self, i: int) -> np.ndarray:
        o = self.arrays["prompt_offsets"]
        return self.arrays["prompt_tokens"][o[i] : o[i + 1]]

    def continuation_of(self, i: int) -> np.ndarray:
        o = self.arrays["cont_offsets"]
        return self.arrays["continuation"][o[i] : o[i + 1]]

    def positions_of(self, i: int) -> range:
        """Global position indices of request i (one per continuation token)."""
        o = self.arrays["cont_offsets"]
        return range(int(o[i]), int(o[i + 1]))

    def position_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """Per global position p [P]: t, its index in its request's continuation, and the tokens in the target's
        cache before its round (prompt + t - 1: every committed token but the root)."""
        o, po = self.arrays["cont_offsets"], self.arrays["prompt_offsets"]
        p = np.arange(int(o[-1]))
        req = np.searchsorted(o, p, side="right") - 1
        t = p - o[req]
        return t, (po[req + 1] - po[req]) + t - 1

    def nodes_of(self, p: int) -> slice:
        o = self.arrays["node_offsets"]
        return slice(int(o[p]), int(o[p + 1]))

    def tree_order(self, p: int, w: int) -> np.ndarray:
        """Local node indices of tree(Kmax, widths[w]) at position p, in the drafter's order (root first)."""
        o = self.arrays["tree_offsets"]
        row = p * len(self.widths) + w
        return self.arrays["tree_nodes"][o[row] : o[row + 1]]

    def predicted(self, p: int) -> np.ndarray | None:
        """Predicted experts of position p's nodes -> bool [N, L, E], or None without a predictor."""
        if not self.has_predictions:
            return None
        L, E = self.num_moe_layers, self.num_experts
        packed = self.arrays["node_predicted"][self.nodes_of(p)]
        return np.unpackbits(packed, axis=1, count=L * E).astype(bool).reshape(-1, L, E)

    def check_models(self, target_digest: str | None = None, drafter_digest: str | None = None) -> None:
        """TraceError unless the trace was recorded with these model digests (None: not checked)."""
        for role, want in (("target", target_digest), ("drafter", drafter_digest)):
            have = self.meta[role].get("digest")
            if want is not None and have is not None and want != have:
                raise TraceError(
                    f"trace {self.path or ''} was recorded with another {role} (digest {have}, this {role} has "
                    f"{want}): record it again with `python -m env.record` for these models"
                )


# ---------------------------------------------------------------------------------------------- IO
def _content_digest(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "content_digest"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def make_trace(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Trace:
    """Validate names/dtypes, stamp the format version and content digest -> Trace."""
    missing = sorted(set(ARRAYS) - set(arrays))
    unknown = sorted(set(arrays) - set(ARRAYS))
    if missing or unknown:
        raise TraceError(f"trace arrays: missing {missing}, unknown {unknown}")
    arrays = {k: np.asarray(arrays[k], dtype=ARRAYS[k][0]) for k in ARRAYS}
    meta = dict(meta, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    meta["content_digest"] = _content_digest(meta, arrays)
    return Trace(meta=meta, arrays=arrays)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: a temporary file in the same folder, fsync, os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write `trace` to `path` (.npz) atomically; returns the path."""
    path = Path(path)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(trace.meta, sort_keys=True).encode(), dtype=np.uint8), **trace.arrays)
    atomic_write_bytes(path, buf.getvalue())
    trace.path = path
    return path


def load_trace(path: str | os.PathLike, target_digest: str | None = None, drafter_digest: str | None = None) -> Trace:
    """Read a trace; TraceError for another format version, a corrupt file or (when given) other model digests."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {path}: record one with `python -m env.record`")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise TraceError(f"{path} is not a readable {FORMAT_NAME} file ({err})") from err
    if meta.get("format") != FORMAT_NAME:
        raise TraceError(f"{path} is not an {FORMAT_NAME} file (format {meta.get('format')!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise TraceError(
            f"{path} has trace format version {version}, this code reads version {FORMAT_VERSION}: "
            "record it again with `python -m env.record`"
        )
    missing = sorted(set(ARRAYS) - set(arrays))
    if missing:
        raise TraceError(f"{path} lacks arrays {missing} of format version {FORMAT_VERSION}")
    for k, (dtype, _) in ARRAYS.items():
        if str(arrays[k].dtype) != dtype:
            raise TraceError(f"{path}: array {k} has dtype {arrays[k].dtype}, expected {dtype}")
    trace = Trace(meta=meta, arrays={k: arrays[k] for k in ARRAYS}, path=path)
    trace.check_models(target_digest, drafter_digest)
    return trace


def concat_parts(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate per-request array dicts (each with local offsets) into one trace's arrays."""
    if not parts:
        raise TraceError("no recorded requests to merge")
    out: dict[str, list[np.ndarray]] = {k: [] for k in ARRAYS}
    base = {"prompt_tokens": 0, "continuation": 0, "nodes": 0, "positions": 0, "cal_target_nodes": 0, "tree_nodes": 0}
    for part in parts:
        for k in ARRAYS:
            a = np.asarray(part[k])
            if k == "prompt_offsets":
                a = a[(1 if out[k] else 0) :] + base["prompt_tokens"]
            elif k == "cont_offsets":
                a = a[(1 if out[k] else 0) :] + base["continuation"]
            elif k == "node_offsets":
                a = a[(1 if out[k] else 0) :] + base["nodes"]
            elif k == "tree_offsets":
                a = a[(1 if out[k] else 0) :] + base["tree_nodes"]
            elif k == "cal_target_offsets":
                a = a[(1 if out[k] else 0) :] + base["cal_target_nodes"]
            elif k in ("cal_target_position", "cal_draft_position"):
                a = a + base["positions"]
            out[k].append(a)
        base["prompt_tokens"] += len(part["prompt_tokens"])
        base["continuation"] += len(part["continuation"])
        base["nodes"] += len(part["node_token"])
        base["positions"] += len(part["node_offsets"]) - 1
        base["cal_target_nodes"] += len(part["cal_target_nodes"])
        base["tree_nodes"] += len(part["tree_nodes"])
    return {k: np.concatenate(chunks, axis=0) for k, chunks in out.items()}
