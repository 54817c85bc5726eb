"""Recording one request of a trace: the target's continuation position by position, with every grid tree.

At position t (committed = prompt + continuation[:t], root = its last token):

    draft     every width W of the grid drafts tree(Kmax, W) on its own drafter sequence (one batched drafter
              forward per depth for all W); Kmax is clipped to the tokens left, as the engine clips K
    union     the trees merged by path (a path is a node's identity), member bits per W, each tree's own
              node order kept (replay's selection breaks ties by it)
    verify    ONE tree-attention target forward of the union: routing of every node; the root's next token is
              the continuation (greedy argmax, or in position mode y_p = argmax(log p + g_p) exactly as
              engine.spec.gumbel.verify_gumbel draws it)
    commit    that one token on every drafter sequence (K = 0-style alignment: the drafters catch up lazily)
    calibrate every `calibrate_every` positions: measured target forwards of random prefix-closed subsets of
              the union and one drafting round of a random (K, W) on a spare drafter sequence

`RequestRecorder(...).run()` returns the request's arrays (env.trace.ARRAYS) with local offsets.

Shape letters: N=union nodes L=MoE layers r=top-r E=experts nW=grid widths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.models.batching import chain_item, pack, tree_item
from engine.models.kv_cache import PagedKVCache
from engine.runtime.context_probe import ContextProbe
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.gumbel import gumbel_argmax, position_gumbel_many
from engine.spec.sampling import SamplingParams, process_logits
from env.trace import ARRAYS

CAL_SIZES = (1, 2, 4, 8, 16, 32, 64)  # verified-token counts of the measured target forwards


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


class RequestRecorder:
    """Records one request (module docstring); `run()` returns its arrays with local offsets."""

    def __init__(
        self,
        target,
        drafter,
        conf: Any,
        prompt: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        lam_record: float,
        request_seed: int,
    ) -> None:
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
            raise ValueError(
                f"prompt {len(prompt)} + {conf.max_new_tokens} new tokens + kmax exceed the context "
                f"{cfg.max_position_embeddings}"
            )
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
        probe, probe_seq = getattr(drafter, "probe", None), len(seqs)  # its own sequence: no draft takes its match
        own_probe = probe is not None
        if own_probe:  # started like the others: the lookup's match source reads the prompt's length
            drafter.start(probe_seq, list(prompt), target_hidden=pre.hidden)
        else:  # a drafter without a probe: a probing policy runs the context probe (engine.runtime.context_probe)
            context = ContextProbe()
            probe = lambda _seq, toks, d, w: context.probe(toks, P, d, w)  # noqa: E731
        gen = torch.Generator().manual_seed(0)  # unused: deterministic children in greedy / position mode
        cont: list[int] = []
        rec: dict[str, list] = {
            k: []
            for k in (
                "node_token",
                "node_parent",
                "node_depth",
                "node_path_prob",
                "node_wmask",
                "node_routing",
                "node_predicted",
                "confidence",
                "node_cond_prob",
                "target_seconds",
                "draft_seconds",
                "probe_seconds",
                "tree_nodes",
            )
        }
        node_offsets = [0]
        tree_offsets = [0]
        cal_t: dict[str, list] = {"cal_target_position": [], "cal_target_nodes": [], "cal_target_seconds": []}
        cal_t_offsets = [0]
        cal_d: dict[str, list] = {
            k: []
            for k in (
                "cal_draft_position",
                "cal_draft_depth",
                "cal_draft_width",
                "cal_draft_aware",
                "cal_draft_seconds",
            )
        }
        finish_eos = False
        try:
            for t in range(conf.max_new_tokens):
                tokens = prompt + cont
                depth = min(conf.kmax, conf.max_new_tokens - t - 1)  # the engine never drafts past the budget
                t0 = time.perf_counter()
                if depth > 0:
                    reqs = [
                        (w, tokens, SpecConfig(depth=depth, width=W, lam=self.lam), self.params, gen)
                        for w, W in enumerate(self.widths)
                    ]
                    trees = drafter.draft_many(reqs)
                else:
                    trees = [DraftTree.root_only(tokens[-1]) for _ in self.widths]
                draft_seconds = time.perf_counter() - t0
                probe_seconds = 0.0  # the probe a policy observing `confidence_now` runs first (Session.probe)
                if depth > 0:
                    t0 = time.perf_counter()
                    probe(probe_seq, tokens, depth, max(self.widths))
                    probe_seconds = time.perf_counter() - t0
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
                rec["probe_seconds"].append(probe_seconds)
                node_offsets.append(node_offsets[-1] + N)
                if on_position is not None:
                    on_position()
                if self.eos is not None and y == self.eos:
                    finish_eos = True
                    break
        finally:
            for s in seqs:
                drafter.finish(s)
            if own_probe:
                drafter.finish(probe_seq)
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
            "probe_seconds": np.asarray(rec["probe_seconds"], dtype=np.float32),
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
