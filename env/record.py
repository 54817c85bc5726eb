"""`python -m env.record`: record replay traces of a workload (env.trace describes the format).

    python -m env.record                                     # built-in mixed workload, greedy, zoo models
    python -m env.record workload.prompts=questions.jsonl    # FastChat / HumanEval-style JSONL
    python -m env.record sampling.temperature=0.7            # seeded drafter-invariant sampling (mode position)

For every request: prefill the prompt, then advance the target's own continuation one position at a
time. At each position every width W of the grid drafts tree(Kmax, W) (one drafter sequence per W, one
batched drafter forward per depth), the union of those trees is verified by ONE tree-attention target
forward (its routing per node; the root's next token is the continuation: greedy argmax, or the
Gumbel-max y_p = argmax(log p + g_p) of engine.spec.gumbel in position mode), and every drafter
sequence commits that one token. Every `calibrate_every` positions the recorder also times target
forwards of random prefix-closed subsets of the union and one drafting round of a random (K, W) on a
spare drafter sequence, for the fitted (measured) cost model.

Caching and resumption: traces live under engine.paths.cache_dir()/traces, named by a digest of
everything that determines them (models, sampling, grid, prompt tokens, budget). Each finished request
is written at once as a shard (<name>.parts/req-00007.npz); a rerun skips shards already there and the
final merge writes <name>.npz atomically, then drops the shards. Sampling in the generator mode is not
replayable exactly and is refused (use mode=position).

Shape letters: N=union nodes L=MoE layers r=top-r E=experts nW=grid widths.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.drafting.protocol import MAX_TREE_NODES
from engine.models.batching import chain_item, pack, tree_item
from engine.models.kv_cache import PagedKVCache
from engine.paths import cache_dir
from engine.spec.config import MAX_DEPTH, MAX_WIDTH, SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.gumbel import gumbel_argmax, position_gumbel_many
from engine.spec.sampling import SamplingParams, process_logits
from engine.workloads import encode, workload
from env.models import ModelInfo, load_models
from env.trace import ARRAYS, FORMAT_VERSION, Trace, TraceError, atomic_write_bytes, concat_parts, make_trace
from env.trace import load_trace, save_trace

CAL_SIZES = (1, 2, 4, 8, 16, 32, 64)  # verified-token counts of the measured target forwards


@dataclass
class WorkloadConf:
    name: str = "mixed"  # code | prose | mixed (engine.workloads), ignored when `prompts` is set
    n: int = 8  # requests
    prompts: str | None = None  # FastChat / HumanEval-style JSONL path


@dataclass
class SamplingConf:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # request i uses seed + i (position mode)
    mode: str = "position"  # the only replayable sampling mode


@dataclass
class RecordConf:
    """What a trace is recorded from (also the Hydra schema of conf/record.yaml)."""

    target: str = "tiny-moe"
    drafter: str = "eagle-head"
    predictor: str | None = "expert-predictor"  # None: no predicted experts (λ > 0 not replayable)
    kmax: int = 8
    widths: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    max_new_tokens: int = 64
    max_prompt_tokens: int = 128
    eos: bool = True  # stop a request at the tokenizer's end-of-text token (id 0 in the zoo)
    calibrate_every: int = 8  # 0: no calibration samples (no fitted cost model)
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    sampling: SamplingConf = field(default_factory=SamplingConf)
    out: str | None = None  # a trace path; None: the cache (engine.paths.cache_dir()/traces)
    progress: bool = True
    threads: int = 1


def check_conf(conf: RecordConf) -> None:
    """ValueError for a grid or sampling the recorder cannot serve, before any model is loaded."""
    if not 1 <= conf.kmax <= min(MAX_DEPTH, 8):
        raise ValueError(f"kmax must be in 1..8 (the observation's KMAX), got {conf.kmax}")
    ws = list(conf.widths)
    if not ws or any(not 1 <= w <= MAX_WIDTH for w in ws) or len(set(ws)) != len(ws) or len(ws) > 16:
        raise ValueError(f"widths must be distinct ints in 1..{MAX_WIDTH}, got {ws}")
    if conf.kmax * max(ws) > MAX_TREE_NODES:
        raise ValueError(f"kmax * max(widths) = {conf.kmax * max(ws)} exceeds the drafter's {MAX_TREE_NODES} nodes")
    if conf.max_new_tokens < 1 or conf.max_prompt_tokens < 2:
        raise ValueError("max_new_tokens must be >= 1 and max_prompt_tokens >= 2")
    s = conf.sampling
    SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=max(s.seed, 0), mode=s.mode)
    if s.temperature > 0 and s.mode != "position":
        raise ValueError(
            "sampled traces replay exactly only with drafter-invariant sampling: set sampling.mode=position "
            f"(got mode={s.mode!r}); or record greedy (sampling.temperature=0)"
        )


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(conf: RecordConf, tokenizer) -> tuple[list[list[int]], str]:
    """Token ids of the workload's prompts (>= 2 tokens each) and a short workload name."""
    w = conf.workload
    prompts = workload(w.name, w.n, w.prompts)
    ids = encode(tokenizer, prompts, conf.max_prompt_tokens)
    usable = [p for p in ids if len(p) >= 2]
    source = w.prompts or w.name
    if not usable:
        raise ValueError(f"workload {source!r} has no usable prompts (need at least one prompt of >= 2 tokens)")
    slug = Path(w.prompts).stem if w.prompts else w.name
    return usable, re.sub(r"[^A-Za-z0-9_.-]+", "_", slug)


def trace_key(conf: RecordConf, info: ModelInfo, prompts: list[list[int]]) -> str:
    """Digest of everything that determines a trace (the cache file name)."""
    blob = {
        "format_version": FORMAT_VERSION,
        "target": info.target_digest,
        "drafter": [info.drafter_name, info.drafter_digest, info.predictor_digest],
        "kmax": conf.kmax,
        "widths": list(conf.widths),
        "max_new_tokens": conf.max_new_tokens,
        "eos": conf.eos,
        "calibrate_every": conf.calibrate_every,
        "sampling": asdict(conf.sampling) if conf.sampling.temperature > 0 else {"temperature": 0.0},
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def default_trace_path(slug: str, key: str) -> Path:
    return cache_dir() / "traces" / f"{slug}-{key}.npz"


# ---------------------------------------------------------------------------------------------- one request
def _random_subset(parents: list[int], size: int, rng: np.random.Generator) -> list[int]:
    """A random prefix-closed node subset of `size` (root 0 included), sorted."""
    chosen = [0]
    inside = {0}
    while len(chosen) < size:
        cand = [i for i in range(1, len(parents)) if i not in inside and parents[i] in inside]
        if not cand:
            break
        j = int(cand[rng.integers(len(cand))])
        chosen.append(j)
        inside.add(j)
    return sorted(chosen)


class _RequestRecorder:
    """Records one request (module docstring); `run()` returns its arrays with local offsets."""

    def __init__(self, target, drafter, conf: RecordConf, prompt: list[int], params: SamplingParams,
                 eos_token_id: int | None, lam_record: float, request_seed: int) -> None:  # fmt: skip
        self.target, self.drafter, self.conf = target, drafter, conf
        self.prompt, self.params, self.eos = list(prompt), params, eos_token_id
        self.lam = lam_record
        self.seed = request_seed
        self.widths = list(conf.widths)
        self.nW = len(self.widths)
        self.L = len(target.moe_blocks)
        cfg = target.config
        self.E = cfg.num_experts
        self.rng = np.random.default_rng([max(request_seed, 0), len(prompt)])
        total = len(prompt) + conf.max_new_tokens + 1
        if total + conf.kmax > cfg.max_position_embeddings:
            raise ValueError(f"prompt {len(prompt)} + {conf.max_new_tokens} new tokens exceed the context {cfg.max_position_embeddings}")
        bs = 16
        scratch = -(-(conf.kmax * sum(self.widths) + 2) // bs) + 2
        self.kv = PagedKVCache.for_model(cfg, -(-total // bs) + scratch + 2, bs, target.dtype, target.device)

    def _forward(self, item, routing: bool = False):
        return self.target.forward_batch(pack([item], self.target.device), self.kv, record_routing=routing)

    def _next_token(self, root_logits: torch.Tensor, position: int) -> int:
        """The token the target commits at absolute `position`, as the engine's verification draws it."""
        if self.params.greedy:
            return int(root_logits.argmax())
        probs = process_logits(root_logits[None], self.params)  # [1, V]
        noise = position_gumbel_many(self.params.seed, [position], probs.shape[-1], probs.device)
        return int(gumbel_argmax(probs.double().log(), noise)[0])

    @torch.inference_mode()
    def run(self, on_position: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
        conf, drafter, kv = self.conf, self.drafter, self.kv
        prompt = self.prompt
        P = len(prompt)
        kv.add_sequence(0)
        kv.reserve(0, P + conf.max_new_tokens + 1)
        committed_slots = kv.slots(0, range(P + conf.max_new_tokens + 1))
        pre = self._forward(chain_item(prompt[:-1], committed_slots[:0], committed_slots[: P - 1]))
        seqs = list(range(self.nW + 1))  # one drafter sequence per width + a spare one for timing
        drafter.prepare([P + conf.max_new_tokens + conf.kmax + 1] * len(seqs))
        for s in seqs:
            drafter.start(s, list(prompt), target_hidden=pre.hidden)
        gen = torch.Generator().manual_seed(0)  # unused: deterministic children in greedy / position mode
        cont: list[int] = []
        rec: dict[str, list] = {k: [] for k in ("node_token", "node_parent", "node_depth", "node_path_prob",
                                                "node_wmask", "node_routing", "node_predicted", "confidence", "node_cond_prob",
                                                "target_seconds", "draft_seconds", "tree_nodes")}  # fmt: skip
        node_offsets = [0]
        tree_offsets = [0]
        cal_t: dict[str, list] = {"cal_target_position": [], "cal_target_nodes": [], "cal_target_seconds": []}
        cal_t_offsets = [0]
        cal_d: dict[str, list] = {k: [] for k in ("cal_draft_position", "cal_draft_depth", "cal_draft_width",
                                                  "cal_draft_aware", "cal_draft_seconds")}  # fmt: skip
        finish_eos = False
        try:
            for t in range(conf.max_new_tokens):
                tokens = prompt + cont
                depth = min(conf.kmax, conf.max_new_tokens - t - 1)  # the engine never drafts past the budget
                t0 = time.perf_counter()
                if depth > 0:
                    reqs = [(w, tokens, SpecConfig(depth=depth, width=W, lam=self.lam), self.params, gen)
                            for w, W in enumerate(self.widths)]  # fmt: skip
                    trees = drafter.draft_many(reqs)
                else:
                    trees = [DraftTree.root_only(tokens[-1]) for _ in self.widths]
                draft_seconds = time.perf_counter() - t0
                # ---- union of the grid's trees (paths are node identities)
                u_tok, u_par, u_dep, u_pp, u_w = [tokens[-1]], [-1], [0], [1.0], [(1 << self.nW) - 1]
                u_pred: list[Any] = [None]
                index: dict[tuple[int, int], int] = {}
                conf_rows = np.zeros((self.nW, conf.kmax), dtype=np.float32)
                for w, tree in enumerate(trees):
                    c = list(tree.confidence)[: conf.kmax]
                    conf_rows[w, : len(c)] = c
                    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
                    pp = tree.path_prob.tolist()
                    pred = tree.predicted_experts
                    if pred is not None and u_pred[0] is None:
                        u_pred[0] = pred[0]
                    local = [0] * len(toks)
                    for i in range(1, len(toks)):
                        key = (local[pars[i]], toks[i])
                        j = index.get(key)
                        if j is None:
                            j = index[key] = len(u_tok)
                            u_tok.append(toks[i])
                            u_par.append(key[0])
                            u_dep.append(deps[i])
                            u_pp.append(pp[i])
                            u_w.append(0)
                            u_pred.append(None if pred is None else pred[i])
                        u_w[j] |= 1 << w
                        local[i] = j
                    rec["tree_nodes"].append(np.asarray(local, dtype=np.int16))
                    tree_offsets.append(tree_offsets[-1] + len(local))
                N = len(u_tok)
                # ---- one verification of the union: routing per node, the continuation's next token
                ctx = committed_slots[: P + t - 1]
                scratch = kv.scratch_slots(0, N - 1) if N > 1 else torch.empty(0, dtype=torch.long)
                write = torch.cat([committed_slots[P + t - 1 : P + t], scratch])
                tok_t, par_t, dep_t = torch.tensor(u_tok), torch.tensor(u_par), torch.tensor(u_dep)
                t1 = time.perf_counter()
                out = self._forward(tree_item(tok_t, par_t, dep_t, ctx, write), routing=True)
                target_seconds = time.perf_counter() - t1
                routing = torch.stack(out.routing.expert_ids, 1).cpu()  # [N, L, r]
                y = self._next_token(out.logits[0], P + t)
                root_hidden = out.hidden[0:1].clone()
                kv.release_scratch(0)
                # ---- calibration: measured target subsets + one drafting round on the spare sequence
                cal_tree = None
                if conf.calibrate_every and t > 0 and t % conf.calibrate_every == 0:
                    for size in [s for s in CAL_SIZES if s <= N]:
                        nodes = _random_subset(u_par, size, self.rng)
                        remap = {j: i for i, j in enumerate(nodes)}
                        sub_par = torch.tensor([-1] + [remap[u_par[j]] for j in nodes[1:]])
                        slots = kv.scratch_slots(0, len(nodes))
                        item = tree_item(tok_t[nodes], sub_par, dep_t[nodes], ctx, slots)
                        t2 = time.perf_counter()
                        self._forward(item, routing=True)
                        cal_t["cal_target_seconds"].append(time.perf_counter() - t2)
                        kv.release_scratch(0)
                        cal_t["cal_target_position"].append(t)
                        cal_t["cal_target_nodes"].extend(nodes)
                        cal_t_offsets.append(cal_t_offsets[-1] + len(nodes))
                    if depth > 0:
                        K = int(self.rng.integers(1, depth + 1))
                        W = int(self.widths[self.rng.integers(self.nW)])
                        aware = self.lam > 0 and bool(self.rng.integers(2))
                        spec = SpecConfig(depth=K, width=W, lam=self.lam if aware else 0.0)
                        cal_tree = drafter.draft_many([(self.nW, tokens, spec, self.params, gen)])[0]
                        cal_d["cal_draft_position"].append(t)
                        cal_d["cal_draft_depth"].append(K)
                        cal_d["cal_draft_width"].append(W)
                        cal_d["cal_draft_aware"].append(aware)
                        cal_d["cal_draft_seconds"].append(cal_tree.draft_seconds)
                # ---- commit one token everywhere
                cont.append(y)
                new_tokens = tokens + [y]
                for s, tree in zip(seqs, [*trees, cal_tree]):
                    tree = tree if tree is not None else DraftTree.root_only(tokens[-1])
                    drafter.commit(s, new_tokens, tree, [], target_hidden=root_hidden)
                # ---- store the position
                rec["node_token"].append(np.asarray(u_tok, dtype=np.int32))
                rec["node_parent"].append(np.asarray(u_par, dtype=np.int16))
                rec["node_depth"].append(np.asarray(u_dep, dtype=np.int8))
                rec["node_path_prob"].append(np.asarray(u_pp, dtype=np.float32))
                pp32 = np.asarray(u_pp, dtype=np.float32).astype(np.float64)
                cond = pp32 / np.where(pp32[np.maximum(u_par, 0)] > 0, pp32[np.maximum(u_par, 0)], 1.0)
                rec["node_cond_prob"].append(cond.astype(np.float32))
                rec["node_wmask"].append(np.asarray(u_w, dtype=np.uint16))
                rec["node_routing"].append(routing.numpy().astype(np.int16))
                if self.lam > 0:
                    rows = [p if p is not None else torch.zeros(self.L, self.E, dtype=torch.bool) for p in u_pred]
                    bits = torch.stack(rows).reshape(N, -1).numpy()
                    rec["node_predicted"].append(np.packbits(bits, axis=1))
                rec["confidence"].append(conf_rows)
                rec["target_seconds"].append(target_seconds)
                rec["draft_seconds"].append(draft_seconds)
                node_offsets.append(node_offsets[-1] + N)
                if on_position is not None:
                    on_position()
                if self.eos is not None and y == self.eos:
                    finish_eos = True
                    break
        finally:
            for s in seqs:
                drafter.finish(s)
            if 0 in kv.seqs:
                kv.release(0)
        L, r = self.L, self.target.config.top_r
        pred_cols = -(-(self.L * self.E) // 8) if self.lam > 0 else 0
        cat = lambda xs, shape, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(shape, dtype=dt)  # noqa: E731
        return {
            "prompt_tokens": np.asarray(prompt, dtype=np.int32),
            "prompt_offsets": np.asarray([0, P], dtype=np.int64),
            "continuation": np.asarray(cont, dtype=np.int32),
            "cont_offsets": np.asarray([0, len(cont)], dtype=np.int64),
            "finish_eos": np.asarray([finish_eos]),
            "request_seed": np.asarray([self.seed], dtype=np.int64),
            "node_offsets": np.asarray(node_offsets, dtype=np.int64),
            "tree_offsets": np.asarray(tree_offsets, dtype=np.int64),
            "tree_nodes": cat(rec["tree_nodes"], (0,), np.int16),
            "confidence": np.stack(rec["confidence"]).astype(np.float32),
            "target_seconds": np.asarray(rec["target_seconds"], dtype=np.float32),
            "draft_seconds": np.asarray(rec["draft_seconds"], dtype=np.float32),
            "node_token": cat(rec["node_token"], (0,), np.int32),
            "node_parent": cat(rec["node_parent"], (0,), np.int16),
            "node_depth": cat(rec["node_depth"], (0,), np.int8),
            "node_path_prob": cat(rec["node_path_prob"], (0,), np.float32),
            "node_cond_prob": cat(rec["node_cond_prob"], (0,), np.float32),
            "node_wmask": cat(rec["node_wmask"], (0,), np.uint16),
            "node_routing": cat(rec["node_routing"], (0, L, r), np.int16),
            "node_predicted": cat(rec["node_predicted"], (0, pred_cols), np.uint8)
            if pred_cols
            else np.zeros((node_offsets[-1], 0), dtype=np.uint8),
            "cal_target_position": np.asarray(cal_t["cal_target_position"], dtype=np.int32),
            "cal_target_offsets": np.asarray(cal_t_offsets, dtype=np.int64),
            "cal_target_nodes": np.asarray(cal_t["cal_target_nodes"], dtype=np.int16),
            "cal_target_seconds": np.asarray(cal_t["cal_target_seconds"], dtype=np.float32),
            **{k: np.asarray(v, dtype=ARRAYS[k][0]) for k, v in cal_d.items()},
        }


# ---------------------------------------------------------------------------------------------- a workload
def _save_part(path: Path, part: dict[str, np.ndarray]) -> None:
    import io

    buf = io.BytesIO()
    np.savez(buf, **part)
    atomic_write_bytes(path, buf.getvalue())


def _load_part(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            part = {k: z[k] for k in z.files}
    except (OSError, ValueError):
        return None  # a torn shard (cannot happen with atomic writes, but never trust it): record it again
    return part if set(part) == set(ARRAYS) else None


def record(
    conf: RecordConf,
    models: tuple[Any, Any, ModelInfo] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    on_position: Callable[[], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Trace:
    """Record (or load from the cache) the trace of `conf`'s workload; see the module docstring.

    models: (target, drafter, ModelInfo) already loaded (default: env.models.load_models of conf);
    prompts: token ids instead of conf.workload. on_start(num_requests, done): called once before
    recording; on_position(): after every recorded position (progress bars). rank / world_size: record
    only requests i with i % world_size == rank (torchrun sharding; rank 0 merges once every shard exists).
    """
    check_conf(conf)
    torch.set_num_threads(max(1, conf.threads))
    target, drafter, info = models if models is not None else load_models(conf.target, conf.drafter, conf.predictor)
    if drafter is None:
        raise ValueError("recording needs a drafter (a feature-head or dense drafter folder)")
    if getattr(drafter, "model", None) is None and not hasattr(drafter, "head"):
        raise ValueError(f"recording needs a model drafter with deterministic children, got {type(drafter).__name__}")
    if prompts is None:
        prompt_ids, slug = load_prompts(conf, target.tokenizer)
    else:
        prompt_ids, slug = [list(map(int, p)) for p in prompts], "prompts"
        if not prompt_ids or any(len(p) < 2 for p in prompt_ids):
            raise ValueError("prompts must be a non-empty list of token lists with >= 2 tokens each")
    key = trace_key(conf, info, prompt_ids)
    out = Path(conf.out) if conf.out else default_trace_path(slug, key)
    if out.is_file():
        try:
            trace = load_trace(out, info.target_digest, info.drafter_digest)
            if trace.meta.get("key") == key:
                return trace
        except TraceError:
            pass  # another format or model: record again
    parts_dir = out.with_suffix(".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    eos = None
    if conf.eos and target.tokenizer is not None:
        eos = target.tokenizer.token_to_id("<|endoftext|>")
    lam_record = 1.0 if getattr(drafter, "predicts_experts", False) else 0.0
    s = conf.sampling
    mine = [i for i in range(len(prompt_ids)) if i % world_size == rank]
    done = [i for i in mine if _load_part(parts_dir / f"req-{i:05d}.npz") is not None]
    if on_start is not None:
        on_start(len(mine), len(done))
    for i in mine:
        if i in done:
            continue
        seed = s.seed + i if s.temperature > 0 else -1
        params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                seed=seed if seed >= 0 else None, mode=s.mode)  # fmt: skip
        part = _RequestRecorder(target, drafter, conf, prompt_ids[i], params, eos, lam_record, seed).run(on_position)
        _save_part(parts_dir / f"req-{i:05d}.npz", part)
    if rank != 0:
        return None  # type: ignore[return-value]
    parts = [_load_part(parts_dir / f"req-{i:05d}.npz") for i in range(len(prompt_ids))]
    if any(p is None for p in parts):
        missing = [i for i, p in enumerate(parts) if p is None]
        raise TraceError(f"shards of requests {missing} are missing in {parts_dir}: run the other ranks / rerun")
    meta = {
        "key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workload": {"name": slug, "source": conf.workload.prompts or conf.workload.name, "n": len(prompt_ids),
                     "max_prompt_tokens": conf.max_prompt_tokens},  # fmt: skip
        "target": info.target_meta(target),
        "drafter": info.drafter_meta(),
        "sampling": asdict(s) if s.temperature > 0 else {"temperature": 0.0, "mode": "greedy"},
        "grid": {"kmax": conf.kmax, "widths": list(conf.widths), "predicted_experts": lam_record > 0},
        "max_new_tokens": conf.max_new_tokens,
        "eos_token_id": eos,
        "calibrate_every": conf.calibrate_every,
        "torch": torch.__version__,
    }
    trace = make_trace(meta, concat_parts(parts))  # type: ignore[arg-type]
    save_trace(trace, out)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return trace


# ---------------------------------------------------------------------------------------------- entry point
def _register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="record_schema", node=RecordConf)


def main() -> None:
    import hydra
    from omegaconf import OmegaConf
    from tqdm import tqdm

    from engine.cli import quiet_hydra_argv

    _register()
    quiet_hydra_argv()

    @hydra.main(config_path="../conf", config_name="record", version_base=None)
    def run(cfg) -> None:
        conf: RecordConf = OmegaConf.to_object(cfg)
        bar = tqdm(total=0, desc="record", unit="pos", dynamic_ncols=True, disable=not conf.progress)

        def on_start(n: int, done: int) -> None:
            bar.total = (n - done) * conf.max_new_tokens
            bar.set_postfix(requests=n, resumed=done)
            bar.refresh()

        rank, world = _dist_rank()
        trace = record(conf, on_position=bar.update, on_start=on_start, rank=rank, world_size=world)
        bar.close()
        if trace is not None:
            n_pos, n_nodes = trace.num_positions, len(trace.node_token)
            print(f"trace {trace.path}\n  {trace.num_requests} requests, {n_pos} positions, "
                  f"{n_nodes / max(n_pos, 1):.1f} union nodes per position, digest {trace.digest}")  # fmt: skip

    run()


def _dist_rank() -> tuple[int, int]:
    """(rank, world size) under torchrun (RANK / WORLD_SIZE), else (0, 1)."""
    import os

    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


if __name__ == "__main__":
    main()
