"""Mock target and drafter with forced one-hot logits for known-answer speculation tables."""

from __future__ import annotations

import torch
from hf_configs import tiny_config

from engine.models.checkpoint import build_model
from engine.models.transformer import ForwardOutput, Model
from engine.spec.draft_tree import DraftTree


class ScriptedTarget(Model):
    """A target whose greedy choice at position p is script[p + 1], whatever the tokens."""

    def __init__(self, script: list[int], vocab: int = 97) -> None:
        real = build_model(tiny_config("llama", vocab_size=vocab))
        super().__init__(real.config)
        self.load_state_dict(real.state_dict())
        self.script = script
        self.eval().requires_grad_(False)

    def forward_batch(
        self,
        batch,
        kv,
        record_routing=False,
        timer=None,
        keep_router_logits=False,
        expert_budget=None,
        feature_layers=None,
    ):
        pos = batch.positions.tolist()
        logits = torch.full((len(pos), self.vocab_size), -10.0)
        for i, p in enumerate(pos):
            logits[i, self.script[p + 1]] = 10.0
        return ForwardOutput(logits=logits, hidden=torch.zeros(len(pos), self.config.hidden_size), routing=None)


class ScriptedDrafter:
    """Proposes script continuations as a chain (or a width-2 tree) with a planted miss at `miss_depth`."""

    def __init__(self, script: list[int], miss_depth: int | None, vocab: int = 97, tree: bool = False) -> None:
        self.script, self.miss_depth, self.vocab, self.tree = script, miss_depth, vocab, tree

    predicts_experts = False

    def prepare(self, lengths):
        pass

    def draft_many(self, requests):
        return [self.draft(*req) for req in requests]

    def start(self, seq_id, tokens, target_hidden=None):
        pass

    def finish(self, seq_id):
        pass

    def commit(self, seq_id, tokens, tree, accepted, target_hidden=None):
        pass

    def draft(self, seq_id, tokens, spec, params, generator):
        L = len(tokens)
        tok, par, dep = [tokens[-1]], [-1], [0]
        chain_parent = 0
        for d in range(1, spec.depth + 1):
            right = self.script[L + d - 1]  # the target's greedy choice at depth d
            if self.tree:  # a wrong sibling first: verification must pick the second child
                tok.append((right + 2) % self.vocab)
                par.append(chain_parent)
                dep.append(d)
            tok.append((right + 1) % self.vocab if d == self.miss_depth else right)
            par.append(chain_parent)
            dep.append(d)
            chain_parent = len(tok) - 1
        return DraftTree(
            tokens=torch.tensor(tok),
            parents=torch.tensor(par),
            depths=torch.tensor(dep),
            path_prob=torch.ones(len(tok)),
        )
