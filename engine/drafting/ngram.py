"""N-gram / prompt-lookup drafter (free): continuations of the longest earlier match of the suffix."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.drafting.protocol import MAX_TREE_NODES, DraftRequest
from engine.drafting.selection import select_verified
from engine.drafting.suffix import SuffixMatch, match_source_py, suffix_match, suffix_match_py
from engine.drafting.tree_growth import _node_budget, kept_by_score, stored_cond
from engine.spec.config import MAX_DEPTH, SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams
from kernels import lookup


class NGramDrafter:
    """Prompt lookup: propose what followed earlier occurrences of the current suffix.

    For n from `max_ngram` down to `min_ngram`, find earlier positions where the last n committed
    tokens occurred; the continuations (most recent first, distinct first tokens become siblings)
    form a tree of width <= W and depth <= K. No model, no KV; draft laws are point masses. Continuations
    are chosen as for a depth-MAX_DEPTH draft and cut to K, so a shallower tree is a prefix of a deeper one
    (trace replay cuts recorded Kmax trees by depth: env.tables).

    Scores (`path_prob`, `confidence`; what the threshold and calibrated verification rules and a controller's
    observation read; the verification itself uses the point masses): a continuation's first token x scores
    (n / max_ngram) · (how often x followed the matched n-gram earlier / how often anything did), its d-th token
    min(max_ngram, n + d - 1) / max_ngram, the suffix it then extends (SuffixDecoding 2411.04975 scores by
    frequency; the match length is what predicts acceptance on the zoo: 22-40 % of first tokens after a
    one-token match, 81-96 % after four). Path score = the product along the path.
    """

    def __init__(self, vocab_size: int, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        # seq -> (len(tokens), depth, width, the match: a SuffixMatch or its fields as the C++ probe returns them)
        self._probed: dict[int, tuple[int, int, int, SuffixMatch | tuple]] = {}
        self._prompt_len: dict[int, int] = {}  # seq -> its prompt's length (`start`)
        self._source: dict[int, tuple[float, float]] = {}  # seq -> its last probe's match source
        fns = lookup.native()  # load (or build) the C++ lookup now, never inside a timed round
        self._native_probe = fns[1] if fns is not None else None

    predicts_experts = False  # no expert predictor: λ > 0 is refused by the engine

    def prepare(self, lengths: list[int]) -> None:
        """Nothing to size: no KV cache."""

    def draft_many(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self.draft(*req) for req in requests]

    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None:
        self._probed.pop(seq_id, None)
        self._prompt_len[seq_id] = len(tokens)

    def finish(self, seq_id: int) -> None:
        self._probed.pop(seq_id, None)
        self._prompt_len.pop(seq_id, None)
        self._source.pop(seq_id, None)

    def commit(self, seq_id, tokens, tree, accepted, target_hidden=None) -> None:
        self._probed.pop(seq_id, None)

    def probe(self, seq_id: int, tokens: list[int], depth: int, width: int) -> list[float]:
        """This round's draft confidence per depth (`DraftTree.confidence` of a depth-`depth`, width-`width` draft
        under rule "all"), before the controller chooses the round's action: what a policy observes as
        `confidence_now` (engine.runtime.observation). The lookup's match is kept for this sequence's next `draft`
        of at most that depth and width, which then takes its continuations instead of matching again, so a
        drafted round pays for the probe once (the same continuations: `suffix_match` of a narrower width keeps the
        wider one's first continuations, and a shallower draft cuts them)."""
        if depth <= 0 or width <= 0:
            self._probed.pop(seq_id, None)
            self._source.pop(seq_id, None)
            return []
        # the prompt's length from `start` (unknown: all of `tokens` counts as prompt)
        conf, match, source = self.lookup_probe(tokens, self._prompt_len.get(seq_id, len(tokens)), depth, width)
        self._probed[seq_id] = (len(tokens), depth, width, match)
        self._source[seq_id] = source
        return conf

    def probe_with_source(
        self, seq_id: int, tokens: list[int], depth: int, width: int
    ) -> tuple[list[float], float, float]:
        """`probe` and `probed_source` in one call (depth, width > 0): (confidence per depth, recency, in_output).
        The hot path of a policy's probe (Session.probe): the C++ call's results are kept as they come, the match
        built only if a draft takes it (`_match`)."""
        n = len(tokens)
        raw = self._lookup_raw(tokens, self._prompt_len.get(seq_id, n), depth, width)
        if raw is None:
            conf = self.probe(seq_id, tokens, depth, width)
            recency, in_output = self._source[seq_id]
            return conf, recency, in_output
        conf, conts, ngram, followers, recency, in_output = raw
        self._probed[seq_id] = (n, depth, width, (conts, ngram, followers))
        self._source[seq_id] = (recency, in_output)
        return conf, recency, in_output

    def lookup_probe_source(
        self, tokens: list[int], prompt_len: int, depth: int, width: int
    ) -> tuple[list[float], float, float]:
        """`lookup_probe` without the match (depth, width > 0): (confidence per depth, recency, in_output)."""
        raw = self._lookup_raw(tokens, prompt_len, depth, width)
        if raw is None:
            conf, _, (recency, in_output) = self.lookup_probe_py(tokens, prompt_len, depth, width)
            return conf, recency, in_output
        return raw[0], raw[4], raw[5]

    def _lookup_raw(self, tokens: list[int], prompt_len: int, depth: int, width: int) -> tuple | None:
        """The C++ probe's (confidence, continuations, ngram, followers, recency, in_output), None without it."""
        fn = self._native_probe
        if fn is None:
            return None
        return fn(tokens, depth, width, self.max_ngram, self.min_ngram, max(MAX_DEPTH, depth), MAX_TREE_NODES,
                  prompt_len)  # fmt: skip

    def probed_source(self, seq_id: int) -> tuple[float, float]:
        """(recency, in_output) of the lookup's match found by this sequence's last `probe` ((0, 0): none)."""
        return self._source.get(seq_id, (0.0, 0.0))

    def probe_py(self, seq_id: int, tokens: list[int], depth: int, width: int) -> list[float]:
        """`probe` in Python (depth, width > 0): the C++ one's reference twin."""
        conf, match, source = self.lookup_probe_py(tokens, self._prompt_len.get(seq_id, len(tokens)), depth, width)
        self._probed[seq_id] = (len(tokens), depth, width, match)
        self._source[seq_id] = source
        return conf

    def lookup_probe(
        self, tokens: list[int], prompt_len: int, depth: int, width: int
    ) -> tuple[list[float], SuffixMatch, tuple[float, float]]:
        """`probe` without state (depth, width > 0): (confidence per depth [<= depth], the match, where it comes from
        (recency, in_output), engine.drafting.suffix.match_source, the first `prompt_len` tokens being the prompt).
        One C++ call (kernels.lookup) when it is built; `lookup_probe_py` is its twin."""
        raw = self._lookup_raw(tokens, prompt_len, depth, width)
        if raw is None:
            return self.lookup_probe_py(tokens, prompt_len, depth, width)
        conf, conts, ngram, followers, recency, in_output = raw
        return conf, SuffixMatch(conts, ngram, followers), (float(recency), float(in_output))

    def lookup_probe_py(
        self, tokens: list[int], prompt_len: int, depth: int, width: int
    ) -> tuple[list[float], SuffixMatch, tuple[float, float]]:
        """`lookup_probe` in Python (the C++ one's reference twin)."""
        source = match_source_py(tokens, prompt_len, self.max_ngram, self.min_ngram)
        match = suffix_match_py(tokens, depth, width, self.max_ngram, self.min_ngram, select_depth=MAX_DEPTH)
        # the growth confidence `_grow` would give, without growing: per depth the best score of the nodes the
        # node budget keeps (each continuation's first tokens, in order)
        left, best = MAX_TREE_NODES, []
        for row in self.scores(match):
            k = min(len(row), left)
            if k <= 0:
                break
            left -= k
            best[: min(k, len(best))] = [max(b, c) for b, c in zip(best, row[:k])]
            best += row[len(best) : k]
        return np.asarray(best, dtype=np.float32).tolist(), match, source

    def _match(self, seq_id: int, tokens: list[int], depth: int, width: int) -> SuffixMatch:
        probed = self._probed.pop(seq_id, None)
        if probed is not None and probed[0] == len(tokens) and depth <= probed[1] and width <= probed[2]:
            m = probed[3]  # the probe's match, narrowed and cut (`probe`)
            if isinstance(m, tuple):  # as `probe_with_source` kept it
                m = SuffixMatch(*m)
            return SuffixMatch([c[:depth] for c in m.continuations[:width]], m.ngram, m.followers)
        # chosen as for the deepest draft, then cut: a depth-K tree is the depth-K prefix of any deeper one
        return suffix_match(tokens, depth, width, self.max_ngram, self.min_ngram, select_depth=MAX_DEPTH)

    def _grow(self, tokens: list[int], match: SuffixMatch, spec: SpecConfig):
        """The lookup tree of `match` within the node budget: (tokens, parents, depths, path scores, {depth: the
        largest conditional score at that depth})."""
        budget = _node_budget(spec)
        tok, par, dep, pp = [tokens[-1]], [-1], [0], [1.0]
        best: dict[int, float] = {}  # depth -> largest conditional score
        for cont, cond in zip(match.continuations, self.scores(match)):
            parent = 0
            for d, (t, c) in enumerate(zip(cont, cond), start=1):
                if len(tok) - 1 >= budget:
                    break
                tok.append(t)
                par.append(parent)
                dep.append(d)
                pp.append(pp[parent] * c)
                best[d] = max(best.get(d, 0.0), c)
                parent = len(tok) - 1
        return tok, par, dep, pp, best

    def scores(self, match: SuffixMatch) -> list[list[float]]:
        """Per continuation, the conditional score of each of its tokens (module docstring of `draft`)."""
        total = sum(match.followers.values())
        out = []
        for cont in match.continuations:
            row = [match.ngram / self.max_ngram * match.followers.get(cont[0], 0) / total] if cont else []
            row += [min(self.max_ngram, match.ngram + d) / self.max_ngram for d in range(1, len(cont))]
            out.append(row)
        return out

    @staticmethod
    def _rule(tokens: list[int], spec: SpecConfig, tok: list[int], par: list[int], dep: list[int], pp: list[float]):
        """The threshold / calibrated verification rule on a lookup tree (`kept_by_score`, as trace replay applies
        it to the recorded one): threshold on the float32 path score, calibrated on the acceptance model's path
        probability; conditional scores as a trace stores them (`stored_cond`)."""
        cond = [1.0] + [stored_cond(pp[j], pp[par[j]]) for j in range(1, len(tok))]
        if spec.verify_rule == "threshold":
            score, thr = [float(np.float32(x)) for x in pp], float(np.float32(spec.verify_threshold))
        else:
            if spec.acceptance is None:
                raise ValueError("verify_rule 'calibrated' needs spec.acceptance (an AcceptanceModel)")
            score, thr = spec.acceptance.tree(tokens, tok, par, cond), float(spec.verify_threshold)
        keep, confidence = kept_by_score(list(range(len(tok))), score, thr, par, dep, cond)
        new = {j: i for i, j in enumerate(keep)}
        return ([tok[j] for j in keep], [new[par[j]] if j else -1 for j in keep], [dep[j] for j in keep],
                [pp[j] for j in keep], confidence)  # fmt: skip

    def draft(
        self,
        seq_id: int,
        tokens: list[int],
        spec: SpecConfig,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        t0 = time.perf_counter()
        tok, par, dep, pp, best = self._grow(tokens, self._match(seq_id, tokens, spec.depth, spec.width), spec)
        confidence = [float(np.float32(best[d])) for d in range(1, max(dep) + 1)] if len(tok) > 1 else []
        if spec.verify_rule in ("threshold", "calibrated") and len(tok) > 1:
            tok, par, dep, pp, confidence = self._rule(tokens, spec, tok, par, dep, pp)
        tree = DraftTree(
            tokens=torch.tensor(tok),
            parents=torch.tensor(par),
            depths=torch.tensor(dep),
            path_prob=torch.tensor(pp, dtype=torch.float32),
            confidence=confidence,
        )
        tree = select_verified(tree, spec, drafted=False)  # max_verify / goodput, as the model drafters select
        tok, par, n = tree.tokens.tolist(), tree.parents.tolist(), tree.num_nodes
        if spec.use_drafted_children and not params.greedy and n > 1:
            # point-mass draft law at each node with children; a node has one child in a chain
            q = torch.zeros(n, self.vocab_size)
            for i in range(1, n):
                q[par[i], tok[i]] = 1.0
            multi = torch.bincount(torch.tensor(par[1:]), minlength=n) > 1
            if bool(multi.any()):  # siblings are not i.i.d. draws: verify by target sampling instead
                q = None
            tree.draft_probs = q
        tree.draft_seconds = time.perf_counter() - t0
        return tree
