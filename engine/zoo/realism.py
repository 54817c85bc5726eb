"""How much a target behaves like a real model on its own greedy path (issue 11 item 6's three figures).

For every prompt, the target decodes greedily (`engine.Engine`, target only, stopping at `eos_token_id`); the
generated tokens g_1..g_N are then scored by one plain forward over prompt + g_1..g_{N-1}, so position j holds
the target's law p_j of g_j given everything before it:

    top_prob  = mean_j max_v p_j(v)                  (1.0: the target is sure of every token it emits)
    entropy   = mean_j -sum_v p_j(v) log p_j(v)      nats (log V: uniform)
    repeat4   = share of the 4-grams lying entirely in g_1..g_N that already occurred earlier in the request
                (prompt included): 0 for fresh text, near 1 for a loop

Means run over all generated positions (4-grams) of all prompts, not per prompt. A target that puts 0.15 on its
top token at 5 nats of entropy and repeats 65 % of its 4-grams is speculated on mostly while it loops.

    figures = greedy_path_figures(target, prompts, new_tokens=64, eos_token_id=0)

Shape letters: N=generated positions V=vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.transformer import Model
from engine.runtime.engine import Engine


@dataclass
class PathFigures:
    """The three figures over one workload's greedy paths (see the module docstring)."""

    positions: int  # generated tokens scored
    top_prob: float
    entropy: float  # nats
    repeat4: float  # share of generated 4-grams repeating an earlier one
    ngrams: int  # generated 4-grams counted


def distribution_sums(logits: torch.Tensor) -> tuple[float, float]:
    """logits [N, V] -> (sum over rows of the top probability, sum over rows of the entropy in nats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    probs = logp.exp()
    entropy = -torch.where(probs > 0, probs * logp, 0.0).sum(-1)  # [N]; 0 log 0 = 0 (masked logits)
    return float(probs.max(-1).values.sum()), float(entropy.sum())


def repeated_ngrams(tokens: Sequence[int], start: int, n: int = 4) -> tuple[int, int]:
    """(repeats, count) of the n-grams tokens[i:i+n] with i >= start (entirely in the generated part) whose tokens
    already occurred as an n-gram starting before i (anywhere earlier in the sequence, the prompt included)."""
    seen: set[tuple[int, ...]] = set()
    repeats = count = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        if i >= start:
            count += 1
            repeats += gram in seen
        seen.add(gram)
    return repeats, count


@torch.inference_mode()
def greedy_path_figures(
    target: Model, prompts: Sequence[Sequence[int]], new_tokens: int, eos_token_id: int | None = None
) -> PathFigures:
    """The three figures of `target` over `prompts` (token ids, >= 1 each); see the module docstring."""
    results = Engine(target, timing=False).generate([list(p) for p in prompts], new_tokens, eos_token_id=eos_token_id)
    top = ent = 0.0
    positions = repeats = grams = 0
    for prompt, res in zip(prompts, results):
        gen = res.token_ids
        if not gen:
            continue
        seq = list(prompt) + gen
        logits = target.logits(torch.tensor([seq[:-1]]))[0, len(prompt) - 1 :]  # [N, V] law of g_j
        t, e = distribution_sums(logits)
        top, ent, positions = top + t, ent + e, positions + len(gen)
        r, c = repeated_ngrams(seq, len(prompt))
        repeats, grams = repeats + r, grams + c
    n = max(positions, 1)
    return PathFigures(positions, top / n, ent / n, repeats / max(grams, 1), grams)
