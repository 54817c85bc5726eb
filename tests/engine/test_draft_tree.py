"""Draft-tree selection: prefix-closed subsets; λ > 0 trades probability for fewer new experts."""

from __future__ import annotations

import torch

from engine.drafting.selection import select_by_probability, select_expert_aware
from engine.spec.draft_tree import DraftTree, ancestor_mask


def _tree(parents, probs, experts=None):
    n = len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return DraftTree(
        tokens=torch.arange(n),
        parents=torch.tensor(parents),
        depths=torch.tensor(depths),
        path_prob=torch.tensor(probs, dtype=torch.float32),
        predicted_experts=experts,
    )


def _prefix_closed(tree, keep):
    s = set(keep.tolist())
    return 0 in s and all(int(tree.parents[i]) in s for i in s if i != 0)


def test_ancestor_mask():
    m = ancestor_mask(torch.tensor([-1, 0, 0, 1, 3]))
    assert m[4].tolist() == [True, True, False, True, True]
    assert m[2].tolist() == [True, False, True, False, False]


def test_select_by_probability_is_prefix_closed_and_best():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = 12
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        cond = torch.rand(n, generator=gen)
        probs = [1.0] * n
        for i in range(1, n):
            probs[i] = probs[parents[i]] * float(cond[i])
        tree = _tree(parents, probs)
        keep = select_by_probability(tree, 5)
        assert len(keep) == 6 and _prefix_closed(tree, keep)
        kept = sorted((probs[i] for i in keep.tolist() if i), reverse=True)
        assert kept == sorted(probs[1:], reverse=True)[:5]


def test_expert_aware_selection_prefers_cheap_nodes():
    # root uses experts {0,1}; node 1 (p=.5) needs {2,3} (2 new); node 2 (p=.45) reuses {0,1}
    L, E = 1, 8
    pred = torch.zeros(3, L, E, dtype=torch.bool)
    pred[0, 0, [0, 1]] = True
    pred[1, 0, [2, 3]] = True
    pred[2, 0, [0, 1]] = True
    tree = _tree([-1, 0, 0], [1.0, 0.5, 0.45], pred)
    assert select_expert_aware(tree, 1, lam=0.0).tolist() == [0, 1]
    assert select_expert_aware(tree, 1, lam=0.5).tolist() == [0, 2]
    assert select_expert_aware(tree, 1, lam=0.5, score="logp").tolist() == [0, 2]


def test_expert_aware_selection_random_trees_prefix_closed_and_fewer_pairs():
    gen = torch.Generator().manual_seed(1)
    fewer = 0
    for _ in range(40):
        n, L, E = 16, 4, 16
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        probs = [1.0] * n
        for i in range(1, n):
            probs[i] = probs[parents[i]] * float(torch.rand(1, generator=gen))
        scores = torch.rand(n, L, E, generator=gen)
        pred = scores >= scores.topk(2, dim=-1).values[..., -1:]
        tree = _tree(parents, probs, pred)
        base = select_by_probability(tree, 6)
        cheap = select_expert_aware(tree, 6, lam=2.0)
        assert len(cheap) == 7 and _prefix_closed(tree, cheap)
        fewer += int(pred[cheap].any(0).sum()) <= int(pred[base].any(0).sum())
    assert fewer >= 36
