"""Cascade (2506.20675) on scripted utilities: base phase, trials, hill-climb direction, the three early stops,
set-phase length 16 doubling on K = 0, and the periodic t_base refresh."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ctrl.policies import CascadePolicy, as_callable, make_policy
from engine.runtime.observation import Observation


def after(i: int, depth: int, committed: int, cost: float, cost_ar: float = 1.0) -> Observation:
    """The observation before round i + 1, after round i ran with K = depth."""
    return Observation(
        round_index=i + 1,
        depth_last=depth,
        accepted_last=committed - 1,
        committed_last=committed,
        cost_last=cost,
        cost_ar=cost_ar,
        position=i + 1,
        max_new_tokens=10_000,
    )


def drive(
    policy: CascadePolicy,
    utility: Callable[[int, int], float],
    rounds: int,
    base_cost: Callable[[int], float] = lambda i: 1.0,
) -> list[int]:
    """Run `rounds` rounds: K = 0 costs base_cost(i) and commits 1; K > 0 commits 2 at the cost giving U(K)."""
    obs, ks = Observation(), []
    for i in range(rounds):
        k = policy.act(obs).depth
        ks.append(k)
        if k == 0:
            obs = after(i, 0, 1, base_cost(i))
        else:
            obs = after(i, k, 2, 2 * base_cost(i) / utility(k, i))
    return ks


def phases(policy: CascadePolicy) -> list[tuple[str, int, int]]:
    return list(policy.blocks)


def test_base_phase_then_hill_climb_up_until_max_trials():
    p = CascadePolicy()
    ks = drive(p, lambda k, i: 1.0 + 0.3 * k, 2 + 16 + 16 + 4)
    # every step raises U by > 10 %: trials at K = 1, 2, 3, 4 (M = 4), then the set phase at the best K
    assert ks[:2] == [0, 0]
    assert ks[2:18] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert ks[18:34] == [4] * 16
    assert p.blocks[:6] == [
        ("base", 0, 2),
        ("test", 1, 4),
        ("test", 2, 4),
        ("test", 3, 4),
        ("test", 4, 4),
        ("set", 4, 16),
    ]
    assert p.stop_reason == "max trials"
    # the next test starts from the best non-zero K measured so far
    assert ks[34:38] == [4] * 4
    assert p.t_base == pytest.approx(1.0)


def test_early_stop_passed_local_maximum_and_restart_from_best():
    u = {1: 1.3, 2: 1.8, 3: 1.4}
    p = CascadePolicy()
    ks = drive(p, lambda k, i: u.get(k, 1.0), 2 + 12 + 16 + 8 + 16)
    assert ks[2:14] == [1] * 4 + [2] * 4 + [3] * 4  # 3 trials: U fell at K = 3
    assert ks[14:30] == [2] * 16
    assert p.blocks[4] == ("set", 2, 16)
    # second test starts at K = 2 (highest measured U), climbs to 3, U falls again -> set K = 2
    assert ks[30:38] == [2] * 4 + [3] * 4
    assert p.stop_reason == "passed local maximum"
    assert ks[38:] == [2] * 16
    assert p.trials == [(2, pytest.approx(1.8)), (3, pytest.approx(1.4))]


def test_early_stop_within_ten_percent():
    u = {1: 1.5, 2: 1.6, 3: 3.0}  # 1.5 -> 1.6 is +6.7 %: stop before ever trying K = 3
    p = CascadePolicy()
    ks = drive(p, lambda k, i: u[k], 2 + 8 + 16)
    assert ks[2:10] == [1] * 4 + [2] * 4
    assert p.stop_reason == "within tolerance"
    assert ks[10:] == [2] * 16
    assert 3 not in ks


def test_early_stop_reached_zero_and_exponential_backoff():
    p = CascadePolicy()
    ks = drive(p, lambda k, i: 0.8, 2 + 4 + 16 + 4 + 32 + 4 + 64 + 4)
    # U < 1 at K = 1: the next K would be 0 -> stop after one trial, set K = 0 for 16, 32, 64 rounds
    assert [b for b in p.blocks if b[0] != "base"][:7] == [
        ("test", 1, 4),
        ("set", 0, 16),
        ("test", 1, 4),
        ("set", 0, 32),
        ("test", 1, 4),
        ("set", 0, 64),
        ("test", 1, 4),
    ]
    assert p.stop_reason == "reached K=0"
    assert ks[6:22] == [0] * 16
    assert p.blocks.count(("base", 0, 2)) == 1  # K = 0 set rounds keep t_base fresh: no extra refresh


def test_backoff_resets_once_speculation_pays_again():
    p = CascadePolicy()
    switch = 2 + 4 + 16 + 4 + 32  # rounds before the third test
    drive(p, lambda k, i: 0.8 if i < switch else {1: 1.5, 2: 1.6}[k], switch + 8 + 16)
    sets = [b for b in p.blocks if b[0] == "set"]
    assert sets[:3] == [("set", 0, 16), ("set", 0, 32), ("set", 2, 16)]
    assert p.zero_streak == 0


def test_hill_climb_down_to_zero():
    u = {3: 0.6, 2: 0.75, 1: 0.9}  # U < 1 at the start K: go down; U rises but stays < 1; next K = 0 -> stop
    p = CascadePolicy(k_init=3)
    ks = drive(p, lambda k, i: u[k], 2 + 12 + 16)
    assert ks[2:14] == [3] * 4 + [2] * 4 + [1] * 4
    assert p.stop_reason == "reached K=0"
    assert ks[14:] == [0] * 16


def test_hill_climb_down_past_a_local_maximum():
    u = {4: 0.9, 3: 1.2, 2: 1.0}
    p = CascadePolicy(k_init=4)
    ks = drive(p, lambda k, i: u[k], 2 + 12 + 16)
    assert ks[2:14] == [4] * 4 + [3] * 4 + [2] * 4
    assert p.stop_reason == "passed local maximum"
    assert ks[14:] == [3] * 16


def test_stop_at_k_max():
    p = CascadePolicy(k_init=2, k_max=2)
    ks = drive(p, lambda k, i: 2.0, 2 + 4 + 16)
    assert ks[2:] == [2] * 20
    assert p.stop_reason == "reached k_max"


def test_periodic_t_base_refresh():
    # every test: 2 trials (consecutive U within 10 %) + 16 set rounds = 24 rounds, all at K > 0
    p = CascadePolicy(base_refresh=100)
    ks = drive(p, lambda k, i: 1.5 + 0.05 * k, 130, base_cost=lambda i: 1.0 if i < 110 else 3.0)
    # after the 5th set phase 120 rounds ran since the last K = 0 round (>= 100): K = 0 again at 122, 123
    bases = [i for i, b in enumerate(p.blocks) if b[0] == "base"]
    assert bases == [0, 16]
    assert [b[0] for b in p.blocks[1:16]] == ["test", "test", "set"] * 5
    assert ks[122:124] == [0, 0] and 0 not in ks[2:122]
    assert p.t_base == pytest.approx(3.0)  # the new baseline
    assert ks[124] > 0


def test_reset_starts_a_new_request():
    p = CascadePolicy()
    drive(p, lambda k, i: 2.0, 40)
    p.reset()
    assert p.phase == "base" and p.history == {} and p.t_base == 0.0
    assert p.act(Observation()).depth == 0


def test_as_callable_resets_on_first_round():
    p = make_policy("cascade")
    fn = as_callable(p)
    drive(p, lambda k, i: 2.0, 40)
    assert p.phase != "base"
    assert fn(Observation()).depth == 0  # a new request: a fresh copy starts in the base phase
    copy0 = fn.__closure__ and next(c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, dict))[-1]
    assert copy0.phase == "base" and len(copy0.blocks) == 1 and p.phase != "base"  # the prototype is untouched


def test_as_callable_keeps_one_policy_per_request():
    fn = as_callable(make_policy("cascade"))
    a = [fn(Observation(request_id=0)).depth, fn(Observation(request_id=1)).depth]
    assert a == [0, 0]  # both requests start their own base measurement


def test_without_costs_utility_falls_back_to_committed_tokens():
    p = CascadePolicy()
    obs = Observation()
    for i in range(7):  # costs unknown (0): U = ETR = 2 >= 1, so the hill climb goes up
        k = p.act(obs).depth
        obs = after(i, k, 1 if k == 0 else 2, 0.0, cost_ar=0.0)
    assert p.history == {1: pytest.approx(2.0)}
    assert p.depth == 2
