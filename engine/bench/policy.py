"""`python -m engine.bench policy`: what a deployed frozen policy costs per round (issue 10 item 3: < 1 %).

    python -m engine.bench policy                           # the main job's cached roofline AggreVaTe, seed 0
    python -m engine.bench policy policy_bench.path=outputs/main/<run>/policies/measured-cpu/aggrevate/seed0

The zoo target with the drafter the main job trains on (EAGLE head + expert predictor) generates every
workload's prompts with the policy deployed (`Engine.generate(policy=...)`), at batch 1 (one request at a time)
and at batch B (all at once). The session times each request-round's choice — observation, policy call and
action check — into `RoundStats.policy_seconds`. Reported per batch size, over all workloads:

    policy µs      median per request-round
    share          Σ policy_seconds / wall time of the policy's generate calls (what the controller takes)
    × plain step   median per request-round / the median target-only decode step of the same batch size,
                   measured interleaved in the same run (the cheapest round the engine can run)
    probe µs       for a policy that observes the probe (`FrozenPolicy.probe`): the probe before the choice, median
                   per request-round (`RoundStats.probe_seconds`), and its share of the wall time. The prompt lookup's
                   own probe is drafting work the round's draft then takes over; the context probe of a drafter
                   without one (engine.runtime.context_probe) is not, so it adds to what the controller takes

and the parts, timed in a loop on one live request: the observation (for the frozen policy its values straight
from the request's history, calibration included), the policy call (C++ or numpy MLP, argmax, action lookup) and the
whole choice with the action check. Not a timed test: figures go to stdout and the JSON.
"""

from __future__ import annotations

import statistics
import time
import timeit
from typing import Any

from engine.bench.common import learned_policy
from engine.bench.configs import BenchConfig
from engine.runtime.observation import observation_values


def _load(cfg: BenchConfig):
    import engine
    from engine.drafting.make import load_feature_drafter
    from engine.paths import zoo_path
    from engine.runtime.frozen import load_frozen_policy

    c = cfg.policy_bench
    path = learned_policy(c.path, c.cost, "policy_bench.path")
    policy = load_frozen_policy(path)  # clear errors for a missing or foreign artefact, before any model loads
    target = engine.load_model(cfg.target or zoo_path("tiny-moe"))
    if c.drafter == "ngram":  # the model-free prompt lookup (`python -m ctrl +experiment=ngram`)
        if c.predictor:
            raise ValueError("policy_bench.drafter=ngram has no expert predictor: set policy_bench.predictor=null")
        return path, policy, target, "ngram"
    predictor = zoo_path(c.predictor) if c.predictor else None
    drafter = load_feature_drafter(zoo_path(c.drafter), target, predictor=predictor)
    return path, policy, target, drafter


def _prompts(cfg: BenchConfig, target) -> dict[str, list[list[int]]]:
    from engine.workloads import encode, workload

    c = cfg.policy_bench
    return {w: encode(target.tokenizer, workload(w, c.num_prompts), cfg.prompt_len) for w in c.workloads}


def _run(eng, prompts: list[list[int]], batch: int, new_tokens: int, policy) -> tuple[float, list[Any]]:
    """(wall seconds, every request-round's RoundStats) of generating `prompts` `batch` at a time."""
    rounds, wall = [], 0.0
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        res = eng.generate(prompts[i : i + batch], new_tokens, policy=policy, eos_token_id=None)
        wall += time.perf_counter() - t0
        rounds += [r for g in res for r in g.rounds]
    return wall, rounds


def parts(eng, policy, prompt: list[int], new_tokens: int, number: int = 2000) -> dict[str, float]:
    """Seconds of what a round pays (the choice) and of its parts, timed in a loop after a few rounds of one
    request: for a policy with `act_vector` (the frozen one) the observation values in Python and the policy call on
    them (the path without the C++ actor), and with the C++ actor its one call computing both (`native_choose`,
    what the choice runs); else the Observation and the policy call on it."""
    sess = eng.start([prompt], new_tokens, policy=policy)
    for _ in range(3):
        if sess.active:
            sess.step()
    rid = sess.active[0] if sess.active else 0
    req = sess.requests[rid]

    def best(f) -> float:
        return min(timeit.repeat(f, number=number, repeat=3)) / number

    if hasattr(policy, "act_vector"):
        top_k, layers = eng._obs_model
        ctx = dict(position=len(req.new_tokens), max_new_tokens=req.max_new, calibration=policy.calibration,
                   top_k=top_k, num_moe_layers=layers)  # fmt: skip
        v = observation_values(req.history, **ctx)
        out = {"observation": best(lambda: observation_values(req.history, **ctx)),
               "policy_call": best(lambda: policy.act_vector(v))}  # fmt: skip
        native = getattr(policy, "_native", None)
        if native is not None:
            args = (req.history, len(req.new_tokens), req.max_new, 1, top_k, layers)
            out["native_choose"] = best(lambda: native.choose(*args))
    else:
        obs = sess.observation(rid)
        out = {"observation": best(lambda: sess.observation(rid)), "policy_call": best(lambda: policy(obs))}
    if sess._chooser is not None:  # what a round pays: the bound C++ chooser's path, else the policy's call
        out["choice"] = best(lambda: sess._chosen([req]))
    else:
        out["choice"] = best(lambda: sess.check_action(sess._choose(req)))
    sess.close()
    return out


def bench_policy(cfg: BenchConfig, progress=None) -> dict[str, Any]:
    import engine

    c = cfg.policy_bench
    path, policy, target, drafter = _load(cfg)
    eng = engine.Engine(target, drafter=drafter)
    prompts = _prompts(cfg, target)
    every = [p for ps in prompts.values() for p in ps]
    eng.generate(every[:1], 4, policy=policy)  # warm-up
    rows = []
    for batch in c.batch_sizes:
        pol_wall = plain_wall = 0.0
        pol_rounds: list[Any] = []
        plain_steps: list[float] = []
        for _ in range(c.repeats):  # interleaved: plain, policy, plain, policy, ...
            w, rs = _run(eng, every, batch, cfg.new_tokens, None)
            plain_wall += w
            plain_steps += [r.round_seconds for r in rs]
            w, rs = _run(eng, every, batch, cfg.new_tokens, policy)
            pol_wall += w
            pol_rounds += rs
            if progress is not None:
                progress()
        per_round = statistics.median(r.policy_seconds for r in pol_rounds)
        step = statistics.median(plain_steps)
        rows.append({
            "batch": batch, "request_rounds": len(pol_rounds), "policy_seconds_median": per_round,
            "policy_seconds_p90": statistics.quantiles([r.policy_seconds for r in pol_rounds], n=10)[-1],
            "share_of_wall": sum(r.policy_seconds for r in pol_rounds) / pol_wall,
            "round_seconds_median": statistics.median(r.round_seconds for r in pol_rounds),
            "plain_step_seconds_median": step, "vs_plain_step": per_round / step,
            "tokens_per_round": sum(r.committed for r in pol_rounds) / len(pol_rounds),
            "probe_seconds_median": statistics.median(r.probe_seconds for r in pol_rounds),
            "probe_share_of_wall": sum(r.probe_seconds for r in pol_rounds) / pol_wall,
            "speedup_vs_plain_wall": plain_wall / pol_wall,
        })  # fmt: skip
    return {"policy": path, "algo": policy.card.get("algo"), "workloads": list(c.workloads),
            "prompts_per_workload": c.num_prompts, "new_tokens": cfg.new_tokens, "threads": cfg.threads,
            "rows": rows, "parts": parts(eng, policy, every[0], cfg.new_tokens)}  # fmt: skip


def print_policy(res: dict) -> None:
    print(f"\n== frozen policy overhead per request-round ({res['policy']}) ==")
    print(f"{res['prompts_per_workload']} prompts × {res['new_tokens']} tokens of {', '.join(res['workloads'])}; "
          f"{res['threads']} thread(s); share = Σ policy time / wall time of the policy's runs")  # fmt: skip
    print(f"{'batch':>5} {'rounds':>7} {'policy µs':>9} {'p90 µs':>7} {'share':>7} {'round ms':>8} "
          f"{'plain step ms':>13} {'× plain step':>12} {'probe µs':>8} {'probe share':>11}")  # fmt: skip
    for r in res["rows"]:
        print(f"{r['batch']:>5} {r['request_rounds']:>7} {r['policy_seconds_median'] * 1e6:>9.1f} "
              f"{r['policy_seconds_p90'] * 1e6:>7.1f} {r['share_of_wall']:>7.2%} "
              f"{r['round_seconds_median'] * 1e3:>8.2f} {r['plain_step_seconds_median'] * 1e3:>13.2f} "
              f"{r['vs_plain_step']:>12.2%} {r['probe_seconds_median'] * 1e6:>8.1f} "
              f"{r['probe_share_of_wall']:>11.2%}")  # fmt: skip
    print("parts (µs, timed in a loop): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in res["parts"].items()))
