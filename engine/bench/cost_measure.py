"""Part 1 of `python -m engine.bench cost`: target forwards over n verified tokens, measured per phase.

The target (`load_target`: zoo/tiny-moe, or random weights of its shape), a stream of real prompt tokens
(`text_stream`), random drafts over that text (`random_draft`: chain, tree or a repeated token) and the
runner that times one forward per draft after a committed context (`ForwardRunner`, CPU-clock phases
with one thread: `CPUPhaseTimer`); `measure_sizes` (T(n) next to T_AR at the same context, medians) and
`measure_samples` (the fit's samples). `engine/bench/cost.py` runs them and fits the cost model.

Shape letters: n=verified tokens c=context r=top-r L=MoE layers E=experts S=samples.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.bench.configs import PHASE_GROUPS, CostBenchConfig
from engine.models.batching import chain_item, pack, tree_item
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model
from engine.timing import PhaseTimer
from engine.zoo.configs import TargetConf, TokenizerConf, target_hf_config

# the tiny target's shape (the zoo's default config), used with random weights while zoo/tiny-moe is not built
TINY_MOE_SHAPE = target_hf_config(TargetConf(), TokenizerConf().vocab_size)


# ---------------------------------------------------------------------------------------------- target
def load_target(path: str | None) -> tuple[Model, str]:
    """(target, description). None: zoo/tiny-moe, or random weights of its shape when it is not built."""
    from engine.models.checkpoint import build_model, load_model

    if path:
        return load_model(path), path
    from engine.paths import zoo_path

    try:
        p = zoo_path("tiny-moe")
    except FileNotFoundError:
        return build_model(TINY_MOE_SHAPE, seed=0), "random weights, tiny-moe shape (zoo/tiny-moe not built)"
    return load_model(p), str(p)


def text_stream(model: Model, workload: str, prompts_path: str | None, num_prompts: int, min_len: int):
    """Token ids [>= min_len] of real prompts back to back (the tokenizer, or UTF-8 bytes without one)."""
    from engine.workloads import workload as load_workload

    ps = load_workload(workload, max(num_prompts, 1), prompts_path)
    if model.tokenizer is not None:
        ids = [t for p in ps for t in model.tokenizer.encode(p.text).ids]
    else:
        ids = [b % model.vocab_size for p in ps for b in p.text.encode("utf-8")]
    if not ids:
        raise ValueError("the workload produced no tokens")
    stream = torch.tensor(ids, dtype=torch.long)
    return stream.repeat(-(-min_len // len(stream)))


# ---------------------------------------------------------------------------------------------- drafts
@dataclass(frozen=True)
class Draft:
    """Root + drafted nodes sent to the target: tokens, parents (−1 for the root), depths, all [n]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    shape: str

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


def random_draft(n: int, shape: str, continuation: torch.Tensor, pool: torch.Tensor, gen: random.Random) -> Draft:
    """A draft of n nodes over real text. continuation [>= n]: the text after the context (root first).

    chain: the real continuation. tree: random parents (the previous node half of the time, else any
    earlier node); first children of main-path nodes continue the real text, others are tokens drawn from
    `pool`. repeat: a chain repeating the root token (few distinct experts at a given n).
    """
    if shape not in ("chain", "tree", "repeat"):
        raise ValueError(f"unknown draft shape {shape!r}; use chain, tree or repeat")
    if shape in ("chain", "repeat"):
        parents = list(range(-1, n - 1))
    else:
        parents = [-1] + [i - 1 if gen.random() < 0.5 else gen.randrange(i) for i in range(1, n)]
    depths, main, tokens, has_child = [0] * n, [True] + [False] * (n - 1), [int(continuation[0])], set()
    for i in range(1, n):
        p = parents[i]
        depths[i] = depths[p] + 1
        main[i] = main[p] and p not in has_child
        has_child.add(p)
        if shape == "repeat":
            tokens.append(tokens[0])
        elif main[i]:
            tokens.append(int(continuation[depths[i]]))
        else:
            tokens.append(int(pool[gen.randrange(len(pool))]))
    return Draft(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), shape)


# ---------------------------------------------------------------------------------------------- measure
class CPUPhaseTimer(PhaseTimer):
    """PhaseTimer on the calling thread's CPU clock: time other processes took is not counted."""

    def __init__(self) -> None:
        super().__init__(sync=False)

    def _now(self) -> float:
        return time.thread_time()


@dataclass
class Forward:
    """One measured target forward: n verified tokens after c context tokens."""

    n: int
    context: int
    shape: str
    seconds: float
    phases: dict[str, float]  # PhaseTimer phases + "other" (the phase-timed forward minus their sum)
    routing: list[torch.Tensor]  # L x [n, r]
    repeats: int = 1  # timings behind `seconds` (their median)
    spread: float = 0.0  # standard deviation of those timings

    def group(self, name: str) -> float:
        return sum(self.phases.get(p, 0.0) for p in PHASE_GROUPS[name])


class ForwardRunner:
    """Target forwards over a paged KV cache holding `windows` prefilled stretches of the text stream.

    Window w caches positions 0..max_context-1 of its text; a forward at context c reads the first c
    slots (causal: the cache of a longer prefill is the cache of the shorter one) and writes its n nodes
    to scratch slots, so the committed cache never changes between forwards.
    """

    def __init__(
        self, model: Model, stream: torch.Tensor, windows: int, max_context: int, max_nodes: int, clock: str
    ) -> None:
        if clock not in ("cpu", "wall"):
            raise ValueError(f"clock must be cpu, wall or auto, got {clock!r}")
        self.model, self.clock = model, clock
        cfg = model.config
        span = max_context + max_nodes + 1
        stride = max(1, (len(stream) - span) // max(windows - 1, 1)) if len(stream) > span else 0
        self.texts = [stream[w * stride : w * stride + span] for w in range(windows)]
        bs = 16
        blocks = windows * (-(-max_context // bs) + -(-max_nodes // bs))
        self.kv = PagedKVCache.for_model(cfg, blocks, bs, model.dtype, model.device)
        self.ctx_slots, self.node_slots = [], []
        with torch.inference_mode():
            for w, text in enumerate(self.texts):
                self.kv.add_sequence(w)
                self.kv.reserve(w, max_context)
                slots = self.kv.slots(w, range(max_context))
                self.model.forward_batch(
                    pack([chain_item(text[:max_context], slots[:0], slots)], model.device), self.kv
                )
                self.ctx_slots.append(slots)
                self.node_slots.append(self.kv.scratch_slots(w, max_nodes))

    def draft(self, window: int, context: int, n: int, shape: str, gen: random.Random) -> Draft:
        text = self.texts[window]
        return random_draft(n, shape, text[context:], text[:context], gen)

    def forward(self, window: int, context: int, draft: Draft) -> Forward:
        """Run and time one forward (batch packing is outside the timed region, as in Engine): `seconds` is the
        forward the engine runs (on CPU one C++ call, engine.models.cpu_stack), then the same forward again with a
        phase timer for `phases` (the per-op path, whose ops it times; "other": that forward minus their sum)."""
        n = draft.num_nodes
        item = tree_item(
            draft.tokens,
            draft.parents,
            draft.depths,
            self.ctx_slots[window][:context],
            self.node_slots[window][:n],
        )
        batch = pack([item], self.model.device)
        timer = CPUPhaseTimer() if self.clock == "cpu" else PhaseTimer()
        now = time.thread_time if self.clock == "cpu" else time.perf_counter
        sync = torch.cuda.synchronize if self.model.device.type == "cuda" else lambda: None
        with torch.inference_mode():
            sync()
            t0 = now()
            out = self.model.forward_batch(batch, self.kv, record_routing=True)
            sync()
            seconds = now() - t0
            t0 = now()
            self.model.forward_batch(batch, self.kv, timer=timer)  # the same K/V writes again: idempotent
            sync()
            timed = now() - t0
        phases = timer.reset()
        phases["other"] = max(timed - sum(phases.values()), 0.0)
        routing = [e.cpu() for e in out.routing.expert_ids] if out.routing else []
        return Forward(n, context, draft.shape, seconds, phases, routing)


def _median_phases(forwards: Sequence[Forward]) -> dict[str, float]:
    keys = sorted({k for f in forwards for k in f.phases})
    return {k: statistics.median(f.phases.get(k, 0.0) for f in forwards) for k in keys}


def measure_sizes(
    runner: ForwardRunner, c: CostBenchConfig, gen: random.Random
) -> tuple[list[dict], list[list[Forward]], list[Forward]]:
    """Per size n: medians of T(n), its phases and its interleaved T(1) partners.

    Returns (rows, the T(n) forwards per size, every T(1) partner forward).
    """
    rows, kept, partners = [], [], []
    for n in c.sizes:
        ar, fw = [], []
        for i in range(c.repeats):
            w = i % len(runner.texts)
            root = runner.draft(w, c.context, 1, "chain", gen)
            ar.append(runner.forward(w, c.context, root))  # T_AR refreshed next to every T(n)
            fw.append(runner.forward(w, c.context, runner.draft(w, c.context, n, c.shapes[i % len(c.shapes)], gen)))
        t_n, t_ar = statistics.median(f.seconds for f in fw), statistics.median(f.seconds for f in ar)
        rows.append(
            dict(
                tokens=n,
                seconds=t_n,
                t_ar=t_ar,
                ratio=t_n / t_ar,
                phases=_median_phases(fw),
                distinct_experts=statistics.median(sum(int(e.unique().numel()) for e in f.routing) for f in fw),
            )
        )
        kept.append(fw)
        partners.extend(ar)
    return rows, kept, partners


def measure_samples(runner: ForwardRunner, c: CostBenchConfig, gen: random.Random) -> list[Forward]:
    """One Forward per (window, context, n, shape) with the median of `fit_repeats` timings.

    Repeats go round-robin over the shuffled samples, so slow drift of the machine spreads over all.
    """
    points = [
        (w, ctx, n, s)
        for w in range(len(runner.texts))
        for ctx in c.fit_contexts
        for n in c.fit_sizes
        for s in c.fit_shapes
        if n > 1 or s == "chain"
    ]
    drafts = [runner.draft(w, ctx, n, s, gen) for w, ctx, n, s in points]
    order = list(range(len(points)))
    timings: list[list[Forward]] = [[] for _ in points]
    for _ in range(c.fit_repeats):
        gen.shuffle(order)
        for i in order:
            timings[i].append(runner.forward(points[i][0], points[i][1], drafts[i]))
    out = []
    for fw in timings:
        f, secs = fw[0], [x.seconds for x in fw]
        spread = statistics.stdev(secs) if len(secs) > 1 else 0.0
        out.append(
            Forward(f.n, f.context, f.shape, statistics.median(secs), _median_phases(fw), f.routing, len(fw), spread)
        )
    return out
