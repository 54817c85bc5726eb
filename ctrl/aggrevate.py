"""AggreVaTe with an exact expert cost-to-go (Ross & Bagnell, arXiv 1406.5979), on trace replay.

In replay an action's outcome at a position does not depend on the history (env.tables), so the exact
cost-to-go of the hindsight oracle is known everywhere: for a request with T positions

    V*(t)    = best return from position t on (env.oracle.plan, objective "return")
    Q*(t, a) = R(t, a) − T_spec(t, a)/T_AR(t) + V*(t + R(t, a))          R = committed tokens

AggreVaTe rolls out a mixture of the oracle (probability β_i = β^i at iteration i) and the current policy,
records the observation of every visited state with its Q*(t, ·) row, aggregates all iterations' states,
and fits the policy to minimise the expected regret Σ_a π(a | obs) · (max_a' Q* − Q*(t, a)) — cost-sensitive
imitation of an expert that sees the future, by a policy that sees only the observation. `entropy` (α, in
tokens, as the regret) subtracts α·H(π(· | obs)). The expected regret is linear in π, so its minimiser over the
logits lies at infinity: the softmax saturates on one action per state, and once saturated, later aggregation
rounds barely move it (the gradient towards another action is scaled by that action's vanishing probability).
With α > 0 the optimum is interior, π ∝ exp(−regret/α), its argmax the least-regret action, and the logits stay
finite (with the warm start of `aggrevate`, α = 0.01 against α = 0 on held-out prompts: +0.2-4 % under the
roofline, within ±1 % under the measured CPU cost). The policy is
the SB3 actor itself (the MultiDiscrete K × W × λ × rule heads; π(a) is the product of the four heads'
probabilities), so freezing and a later PPO fine-tune work unchanged.

`expert="static"` replaces the oracle by the best static grid action a_s of the env's training requests
(one step of policy iteration over it, conservative where the oracle is optimistic):

    V_s(t)    = R(t, a_s) − T_spec(t, a_s)/T_AR(t) + V_s(t + R(t, a_s))
    Q_s(t, a) = R(t, a) − T_spec(t, a)/T_AR(t) + V_s(t + R(t, a))

and rolls in with a_s. Under a cost with a warm-up surcharge (the fitted kind: a request's first R rounds after its
prefill cost w(i) more whatever they run, engine.cost.warmup) the state is (t, round index i ≤ R): every Q and V above
takes i, each round subtracts w(i)/T_AR(t), and the next state is (t + R(t, a), min(i + 1, R)) — still exact, so
committing more tokens in the expensive first rounds is priced. A switching surcharge (engine.cost.switching: a
round of the other kind than the one before it costs more) adds the previous round's kind to the state the same way
(env.oracle.RoundStates), so alternating between plain decoding and speculation is priced too.

Q* assumes the future is played perfectly, so the actor fitted to it drafts as if the next rounds will be fully
accepted; Q_s prices every action against what the best fixed action would then
do, so a policy with zero regret against it is at least as good as a_s on its states (policy improvement).

Shape letters: B=states A=grid actions (flat, env.actions.ActionCodec order) T=positions S=round states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def oracle_q(env: Any, request: int) -> np.ndarray:
    """Q*(t, s, a) [T, S, A] of every position t, round state s (env.oracle.RoundStates: the round index under a
    warm-up surcharge, the previous round's kind under a switching one; S = 1 without either) and flat grid action a."""
    from env.oracle import plan

    e = env.unwrapped
    return _q(_request(e, request), plan(e, request, "return").value)


def static_q(env: Any, request: int, action: int) -> np.ndarray:
    """Q_s(t, s, a) [T, S, A]: every action at (t, s), then the static flat action `action` to the end of
    `request`."""
    e = env.unwrapped
    tab = committed, reward, ar, verifying, st, held = _request(e, request)
    T = len(committed)
    value = np.zeros((T + 1, st.size))
    for t in range(T - 1, -1, -1):
        v = int(verifying[t, action])
        nxt, s = min(t + int(committed[t, action]), T), st.after[:, v]
        if held is not None and held.starts[t, action]:  # the plain rounds it holds, then the value where they land
            ahead = held.gain[nxt, s] + value[held.land_t[nxt], held.land_s[nxt, s]]
        else:
            ahead = value[nxt, s]
        value[t] = reward[t, action] - st.surcharge[:, v] / ar[t] + ahead
    return _q(tab, value)


Request = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any, Any]


def _request(e: Any, request: int) -> Request:
    """(committed [T, A], R − T_spec/T_AR [T, A], T_AR [T], verifying [T, A], RoundStates, HeldTables or None) of
    `request` (env.oracle.request_tables, env.oracle.round_states, env.held.held_tables)."""
    from env.held import held_tables
    from env.oracle import request_tables, round_states

    committed, cost, ar, verifying = request_tables(e, request)
    return committed, committed - cost / ar[:, None], ar, verifying, round_states(e), held_tables(e, request)


def _q(tab: Request, value: np.ndarray) -> np.ndarray:
    """Q(t, s, a) [T, S, A] = R(t, a) − (T_spec(t, a) + surcharge(s, a verifies))/T_AR(t) + V(t + R(t, a), next state)
    for a value-to-go V [T + 1, S] (env.oracle.RoundStates); under a hold, V after an action that starts one is the
    held rounds' return, then V where they land (env.held.HeldTables)."""
    committed, reward, ar, verifying, st, held = tab
    T = len(committed)
    nxt = np.minimum(np.arange(T)[:, None] + committed, T)  # [T, A]
    rows = np.arange(st.size)[None, :, None]
    v = verifying[:, None, :]  # [T, 1, A]
    after = st.after[rows, v]  # [T, S, A]
    ahead = value[nxt[:, None, :], after]  # [T, S, A]
    if held is not None:
        ahead = np.where(held.starts[:, None, :], held.ahead(value)[nxt[:, None, :], after], ahead)
    return reward[:, None, :] - st.surcharge[rows, v] / ar[:, None, None] + ahead


def best_static_action(env: Any, requests: Sequence[int]) -> int:
    """The flat grid action of least total cost over `requests` used statically (ctrl.rollout.static_costs)."""
    from ctrl.rollout import static_costs

    return int(np.argmin(static_costs(env, [int(i) for i in requests])))


EXPERTS = ("oracle", "static")


def joint_log_prob(policy: Any, obs: torch.Tensor, nvec: Sequence[int]) -> torch.Tensor:
    """log π(a | obs) [B, A] over every flat action a from the SB3 MultiCategorical heads."""
    dist = policy.get_distribution(obs)
    heads = [torch.log_softmax(d.logits, dim=-1) for d in dist.distribution]  # 4 x [B, n_d]
    B = obs.shape[0]
    lp = heads[0].view(B, -1, 1, 1, 1) + heads[1].view(B, 1, -1, 1, 1)
    lp = lp + heads[2].view(B, 1, 1, -1, 1) + heads[3].view(B, 1, 1, 1, -1)
    return lp.reshape(B, int(np.prod(nvec)))


def regret_loss(log_prob: torch.Tensor, regret: torch.Tensor, entropy: float = 0.0) -> torch.Tensor:
    """Mean over states of E_π[regret] − α·H(π): log π [B, A], regret [B, A] >= 0 (module docstring)."""
    p = log_prob.exp()
    return (p * (regret + entropy * log_prob)).sum(dim=1).mean()


Expert = tuple[int | None, dict[int, np.ndarray]]  # (static action a_s or None: the oracle, Q rows per request)


def experts(envs: Sequence[Any], requests: Sequence[Sequence[int]], expert: str = "oracle") -> list[Expert]:
    """Each env's expert: its Q rows [T, S, A] per request (oracle_q, or static_q of its best static action).
    They do not change between iterations, so they are computed once."""
    out = []
    for env, reqs in zip(envs, requests):
        e = env.unwrapped
        a_s = best_static_action(e, reqs) if expert == "static" else None
        out.append((a_s, {int(i): oracle_q(e, i) if a_s is None else static_q(e, i, a_s) for i in reqs}))
    return out


def collect(envs: Sequence[Any], requests: Sequence[Sequence[int]], policy: Any, beta: float, rng: np.random.Generator,
            expert: Sequence[Expert]) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:  # fmt: skip
    """States visited by the β-mixture of the expert and the policy, with the expert's Q rows and the flat
    actions taken."""
    from env.oracle import round_states

    obs_out, q_out, act_out = [], [], []
    for env, reqs, (a_s, qs) in zip(envs, requests, expert):
        e = env.unwrapped
        states = round_states(e)
        for i in reqs:
            q = qs[int(i)]  # [T, S, A]
            vec, _ = e.reset(options={"request": int(i)})
            done = False
            while not done:
                row = q[e.position, states.of_episode(e)]  # the round state (warm-up, switching)
                obs_out.append(vec.copy())
                q_out.append(row)
                if rng.random() < beta:
                    a = int(np.argmax(row)) if a_s is None else a_s
                else:
                    with torch.no_grad():
                        lp = joint_log_prob(policy, torch.as_tensor(vec).unsqueeze(0), e.codec.nvec)
                    a = int(lp.argmax())
                act_out.append(a)
                vec, _, term, trunc, _ = e.step(e.codec.encode(e.codec.unflat(a)))
                done = term or trunc
    return obs_out, q_out, act_out


def _snapshot(policy: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def policy_return(envs: Sequence[Any], requests: Sequence[Sequence[int]], policy: Any) -> float:
    """Total episode return Σ (R − T_spec/T_AR) of `policy` alone (argmax actions) over `requests` (the env's
    reward of each round, from its RoundStats)."""
    from ctrl.rollout import run_requests

    total = 0.0
    for env, reqs in zip(envs, requests):
        codec = env.unwrapped.codec

        def act(vec, codec=codec):
            with torch.no_grad():
                a = int(joint_log_prob(policy, torch.as_tensor(vec).unsqueeze(0), codec.nvec).argmax())
            return codec.encode(codec.unflat(a))

        for rounds in run_requests(env, [int(i) for i in reqs], act, "index"):
            for r in rounds:
                total += float(r.committed - r.cost / r.cost_ar)
    return total


def aggrevate(
    policy: Any,
    envs: Sequence[Any],
    requests: Sequence[Sequence[int]],
    iterations: int = 6,
    epochs: int = 30,
    batch_size: int = 256,
    lr: float = 3e-3,
    beta: float = 0.5,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    expert: str = "oracle",
    entropy: float = 0.0,
    warm_start: bool = True,
    on_return: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fit `policy` (an SB3 ActorCriticPolicy) in place; returns the mean regret after each iteration.

    `warm_start`: first clone the expert's own actions on its own states (cross-entropy), so the regret fit starts
    from the expert instead of a random actor. Without it the independent K, W, λ, rule heads fall into K = 0:
    while W and the rule are still random every K > 0 carries their average regret and K = 0 none (on
    prompt-lookup traces under the measured CPU cost K = 0 is the best action in 63 % of the expert's states and
    costs about as much as the best K on average), and from there the rollouts never leave it. The policy kept is
    then the one, clone or iteration, whose own rollouts on the training requests return the most (DAgger's
    guarantee is for the best policy of the sequence, 1011.0686 / 1406.5979). `on_return(i, r)`: each candidate's
    return on the training requests (i = -1: the clone, then the iterations), for logging."""
    if expert not in EXPERTS:
        raise ValueError(f"aggrevate expert must be one of {EXPERTS}, got {expert!r}")
    if entropy < 0:
        raise ValueError(f"aggrevate entropy must be >= 0, got {entropy}")
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    nvec = envs[0].unwrapped.codec.nvec
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    data_obs: list[np.ndarray] = []
    data_q: list[np.ndarray] = []
    history = []
    expert_q = experts(envs, requests, expert)
    best: tuple[float, dict] | None = None
    if warm_start:  # behaviour cloning of the expert's own actions on its own states: the iterations start there
        o, _, acts = collect(envs, requests, policy, 1.0, rng, expert_q)
        X = torch.as_tensor(np.stack(o), dtype=torch.float32)
        labels = torch.as_tensor(acts)
        policy.train()
        for _ in range(epochs):
            perm = torch.randperm(X.shape[0], generator=gen)
            for s in range(0, X.shape[0], batch_size):
                idx = perm[s : s + batch_size]
                loss = -joint_log_prob(policy, X[idx], nvec).gather(1, labels[idx, None]).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        policy.eval()
        best = (policy_return(envs, requests, policy), _snapshot(policy))
        if on_return is not None:
            on_return(-1, best[0])
    for it in range(iterations):
        o, q, _ = collect(envs, requests, policy, beta**it, rng, expert_q)
        data_obs += o
        data_q += q
        X = torch.as_tensor(np.stack(data_obs), dtype=torch.float32)
        Q = torch.as_tensor(np.stack(data_q), dtype=torch.float32)
        regret = Q.max(dim=1, keepdim=True).values - Q  # [B, A] >= 0
        policy.train()
        for _ in range(epochs):
            perm = torch.randperm(X.shape[0], generator=gen)
            for s in range(0, X.shape[0], batch_size):
                idx = perm[s : s + batch_size]
                loss = regret_loss(joint_log_prob(policy, X[idx], nvec), regret[idx], entropy)
                opt.zero_grad()
                loss.backward()
                opt.step()
        policy.eval()
        with torch.no_grad():
            p = joint_log_prob(policy, X, nvec).exp()
            history.append(float((p * regret).sum(dim=1).mean()))
        ret = policy_return(envs, requests, policy)
        if on_return is not None:
            on_return(it, ret)
        if best is None or ret > best[0]:
            best = (ret, _snapshot(policy))
        if progress is not None:
            progress(1)  # one aggregation round done
    if best is not None:
        policy.load_state_dict(best[1])
    return history
