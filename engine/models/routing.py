"""DeepSeek-V3's router (2412.19437 §2.1.2, "auxiliary-loss-free" balancing), also GLM-4.5's.

    scores  = sigmoid(router_logits)                         [T, E]  (float32)
    choice  = scores + e_score_correction_bias               bias steers WHICH experts, never their weight
    groups  : E experts in n_group groups; a group's score is the sum of its 2 best `choice` values;
              only the topk_group best groups stay eligible (device-limited routing)
    experts = top-r of `choice` over the eligible groups
    weights = scores[experts] (/ their sum iff norm_topk_prob, + 1e-20) * routed_scaling_factor

Shape letters: T=tokens E=experts G=groups r=top-r B=expert budget.
"""

from __future__ import annotations

import torch


def budget_applies(num_tokens: int, num_experts: int, expert_budget: int | None, top_r: int) -> bool:
    """Whether MoE-Spec's expert budget changes the routing of these tokens: a budget B with r <= B < E and more
    than one token (else routing is exact)."""
    return expert_budget is not None and num_tokens > 1 and top_r <= expert_budget < num_experts


def budget_dropped(scores: torch.Tensor, expert_budget: int | None, top_r: int) -> torch.Tensor | None:
    """MoE-Spec's verification-time expert budget (2602.16052, approximate): scores [T, E] (router probabilities
    or sigmoid scores) -> bool [E], True for the experts outside the B of largest score summed over the T tokens;
    None when the budget does not apply (`budget_applies`)."""
    T, E = scores.shape
    if not budget_applies(T, E, expert_budget, top_r):
        return None
    keep = scores.sum(0).topk(expert_budget).indices  # [B]
    return torch.ones(E, dtype=torch.bool, device=scores.device).index_fill_(0, keep, False)


def sigmoid_group_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_r: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    expert_budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> topk_weights [T, r] float32, expert_ids [T, r] int64 (see the module docstring).

    expert_budget B (MoE-Spec's approximate mode, 2602.16052; T > 1, r <= B < E): only the B experts with the
    largest score summed over the T tokens stay eligible, and they replace the group limit (which could
    otherwise leave a token fewer than r eligible experts)."""
    T, E = router_logits.shape
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    dropped = budget_dropped(scores, expert_budget, top_r)
    if dropped is not None:
        choice = choice.masked_fill(dropped, float("-inf"))
    elif topk_group < n_group:
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    expert_ids = choice.topk(top_r, dim=-1).indices  # [T, r]
    topk_weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, expert_ids
