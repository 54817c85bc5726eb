"""The main job and the learned-policy path: `python -m ctrl` smoke run, freezing, deployment in the engine,
W&B tracking modes, Hydra composition, and clear errors before any work."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import engine
from ctrl.agent import train_policy
from ctrl.config import AlgoConf, MainConf, WandbConf
from ctrl.pipeline import check_conf, fit_acceptance_model, grid_of, replay_env, split
from engine.paths import zoo_path
from engine.runtime.frozen import load_frozen_policy
from engine.runtime.observation import OBS_DIM, as_vector
from kernels import tanh_mlp

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"static-best-train", "static-best-test", "cascade", "evict", "ucb", "disco", "sglang-adaptive",
            "vllm-table", "vllm-goodput", "ppo", "aggrevate", "oracle", "target-only"}  # fmt: skip
ROW_FIELDS = {"policy", "workload", "backend", "cost_model", "exact", "committed_per_cost",
              "committed_per_expert_execution", "speedup_vs_ar", "tau", "mean_distinct_experts", "p50_tpot",
              "p95_tpot", "p99_tpot", "frac_requests_slowed"}  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "EXPERTSPEC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("main")
    run = tmp / "run"
    cmd = [sys.executable, "-m", "ctrl", "+experiment=main_smoke", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, run, proc


def test_main_job_smoke_writes_results_report_and_plots(smoke_run):
    _, run, proc = smoke_run
    rows = json.loads((run / "results.json").read_text())
    assert {r["policy"] for r in rows} >= FAMILIES
    assert all(set(r) >= ROW_FIELDS for r in rows)
    assert {r["cost_model"] for r in rows} == {"roofline-h200-qwen3_30b_a3b", "measured-cpu"}
    for r in rows:  # each request's own speed-up, from which the share slowed follows (a seeds' mean: per request)
        assert len(r["request_speedups"]) == r["requests"] and all(x > 0 for x in r["request_speedups"])
        if "seeds" not in r:
            assert r["frac_requests_slowed"] == pytest.approx(np.mean([x < 1 - 1e-9 for x in r["request_speedups"]]))
    live = [r for r in rows if r["backend"] == "live"]
    assert live and all(r["committed_per_cost"] == r["replay_committed_per_cost"] for r in live)  # live == replay
    for r in [r for r in rows if r["backend"] == "replay"]:  # the oracle bounds every policy on its trace and cost
        oracle = next(o for o in rows if o["policy"] == "oracle" and o["workload"] == r["workload"]
                      and o["cost_model"] == r["cost_model"] and o["backend"] == "replay")  # fmt: skip
        assert r["committed_per_cost"] <= oracle["committed_per_cost"] * (1 + 1e-9), r["policy"]
        assert np.isfinite(r["committed_per_cost"]) and r["committed_per_cost"] > 0
    report = (run / "report.md").read_text()
    assert "## Exact methods" in report and "static-best-train" in report and "share of the oracle" in report
    assert "fit on the training prompts" in report and "per 16 tokens" in report
    extras = json.loads((run / "extras.json").read_text())
    for cost, x in extras.items():  # every learner, workload and seed: its fit on its own training prompts
        fits = [f for per_wl in x["train_fit"].values() for seeds in per_wl.values() for f in seeds]
        assert fits and all(np.isfinite(f) and f > 0 for f in fits)
        # hindsight schedules: coarser than the oracle, finer than one action for all, finer spans never worse
        for wl, h in x["hindsight"].items():
            cpc = {r["policy"]: r["committed_per_cost"] for r in rows if r["workload"] == wl
                   and r["cost_model"] == cost and r["backend"] == "replay"}  # fmt: skip
            chain = [1.0, h["request"], h["32"], h["16"], h["8"], h["4"], cpc["oracle"] / cpc["static-best-test"]]
            assert all(a <= b * (1 + 1e-9) for a, b in zip(chain, chain[1:])), (cost, wl, chain)
    assert list((run / "plots").rglob("policies.png")) and list((run / "policies").rglob("policy.pt"))
    assert len(list((run / "plots").rglob("headroom.png"))) == 2  # one per cost model
    assert "speed-up over target-only decoding" in proc.stdout and "report:" in proc.stdout
    printed = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    exact = {r["policy"] for r in rows if r["exact"] and "-seed" not in r["policy"]} - {"target-only"}
    assert exact <= printed, exact - printed  # every exact family is in the printed table, DISCO and UCB included
    assert "÷ static-best-test:" in proc.stdout and "goal ≥ 1.10" in proc.stdout


def test_main_job_second_run_reuses_traces_and_policies(smoke_run):
    """The first run records and runs its two cost models in two processes (workers=2, the default); a second
    run in one process finds the traces and policies cached and reproduces every figure."""
    tmp, _, first = smoke_run
    run2 = tmp / "run2"
    cmd = [sys.executable, "-m", "ctrl", "+experiment=main_smoke", f"hydra.run.dir={run2}", "workers=1"]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train PPO" not in proc.stderr  # cached frozen policies: no retraining
    a = json.loads((tmp / "run" / "results.json").read_text())
    b = json.loads((run2 / "results.json").read_text())
    assert a == b


def test_evaluate_on_request_under_the_offload_and_ep_regimes(smoke_run):
    """`ctrl.evaluate +experiment=regimes` on the smoke run's cache: the roofline-trained policies evaluated
    unchanged under the offloaded and the EP cost (no training), every row naming its cost model."""
    tmp, _, _ = smoke_run
    run = tmp / "regimes"
    cmd = [sys.executable, "-m", "ctrl.evaluate", "+experiment=[main_smoke,regimes]", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train " not in proc.stderr  # the roofline policies of the smoke run are reused
    rows = json.loads((run / "results.json").read_text())
    offload, ep = "offload-h200-qwen3_30b_a3b", "ep8-h200-qwen3_30b_a3b"
    assert {r["cost_model"] for r in rows} == {"roofline-h200-qwen3_30b_a3b", offload, ep}
    assert all(set(r) >= ROW_FIELDS for r in rows)
    for cost in (offload, ep):
        mine = [r for r in rows if r["cost_model"] == cost]
        assert {r["policy"] for r in mine} >= FAMILIES and all(r["backend"] == "replay" for r in mine)
        assert all(r["trained_under"] == "roofline-h200-qwen3_30b_a3b" for r in mine if "trained_under" in r)
        assert all(r["speedup_vs_ar"] == pytest.approx(1.0, abs=1e-12) for r in mine if r["policy"] == "target-only")
    oracle = {(r["cost_model"], r["workload"]): r for r in rows if r["policy"] == "oracle"}
    for (cost, workload), o in oracle.items():
        if cost == offload:  # it plans on plain decoding's cache: a hindsight policy, not a bound
            assert o["bound"] is False
            continue
        assert "bound" not in o  # EP is stateless: the DP is exact, the oracle bounds every policy
        for r in rows:
            if r["cost_model"] == cost and r["workload"] == workload:
                assert r["committed_per_cost"] <= o["committed_per_cost"] * (1 + 1e-9), r["policy"]
    report = (run / "report.md").read_text()
    assert "OFFLOADED to host memory" in report and "EXPERT PARALLELISM over 8 GPUs" in report
    assert "transfer result" in report


def test_main_job_with_the_prompt_lookup_drafter(tmp_path):
    """`python -m ctrl +experiment=ngram` (smoke budget): the model-free drafter records, trains, evaluates and
    replays exactly on the live engine; its boundary says how drafting was priced."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ctrl", "+experiment=[main_smoke,ngram]", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((run / "results.json").read_text())
    assert {r["policy"] for r in rows} >= FAMILIES
    live = [r for r in rows if r["backend"] == "live"]
    assert live and all(r["committed_per_cost"] == r["replay_committed_per_cost"] for r in live)  # live == replay
    report = (run / "report.md").read_text()
    assert "drafter prompt lookup (n-gram, model-free)" in report and "host-side prompt lookup" in report
    _probe_policy_deploys_exactly(next((run / "policies" / "measured-cpu" / "aggrevate").glob("seed*")), tmp_path)


def test_main_job_s_policy_observes_the_context_probe(smoke_run):
    """The default job's drafter (the EAGLE head) has no probe: each learner is trained with and without the context
    probe (the prompt lookup on the host, engine.runtime.context_probe) and the variant that does better on the
    training prompts is kept (the report says which, with both figures); the context-probe variant deploys exactly as
    replay observed it."""
    tmp, run, _ = smoke_run
    extras = json.loads((run / "extras.json").read_text())
    report = (run / "report.md").read_text()
    assert "trained with and without the context probe" in report
    for cost in ("roofline-h200-qwen3_30b_a3b", "measured-cpu"):
        for learner in ("aggrevate", "ppo"):
            sel = extras[cost]["probe_selection"][learner]
            fits = sel["train_committed_per_cost"]
            assert set(fits) == {"context-probe", "no-probe"} and sel["selected"] == max(fits, key=fits.get)
            kept = load_frozen_policy(next((run / "policies" / cost / learner).glob("seed*")))
            assert (kept.probe is not None) == (sel["selected"] == "context-probe"), (cost, learner)
            assert f"{cost} · {learner}: **{sel['selected']}**" in report
    variant = next((tmp / "cache" / "policies").glob("*/measured-cpu/aggrevate/variants/context-probe/seed0"))
    _probe_policy_deploys_exactly(variant, tmp, ("eagle-head", "expert-predictor"))


def _probe_policy_deploys_exactly(path: Path, tmp_path: Path, drafter: tuple = ("ngram", None)) -> None:
    """A learned policy observes the probe (`confidence_now`, `match_now`): deployed in the engine, the session
    probes the tree its card names before every choice; the probe equals what replay observed at that position (the
    lookup: the trace's recorded confidence, with the match source replay computes from the trace's tokens; a drafter
    without a probe: the context probe replay computes from them); the session's one native call decides as `act` on
    the Observation, and greedy output equals target-only output."""
    from engine.runtime.observation import KMAX
    from env.models import load_models
    from env.probes import context_probes, probed_sources
    from env.trace import load_trace

    policy = load_frozen_policy(path)
    assert policy.probe == (4, 2)  # the smoke grid's Kmax and widest W
    trace = load_trace(next((tmp_path / "cache" / "traces").glob("code-*.npz")))
    target, draft, _ = load_models("tiny-moe", *drafter)
    own = drafter[0] == "ngram"
    eng = engine.Engine(target, drafter=draft, calibration=policy.calibration, acceptance=policy.acceptance)
    req = trace.num_requests - 1  # a held-out request
    t_all, _ = trace.position_steps()
    context = None if own else context_probes(trace, np.minimum(4, trace.meta["max_new_tokens"] - t_all - 1), 2)
    sources = probed_sources(trace) if own else None
    prompt, n_new = trace.prompt(req).tolist(), len(trace.continuation_of(req))
    sess = eng.start([prompt], n_new, policy=policy)
    probes = 0
    while not sess.done:
        r = sess.requests[0]
        t = len(r.new_tokens)
        probe = sess.probe(0, *policy.probe)
        p = trace.positions_of(req).start + t
        if not own:
            assert probe == context[p], t
        elif probe:  # the probe's values: its confidences padded to KMAX, then where its match comes from
            want = trace.confidence[p, trace.widths.index(2), : policy.probe[0]]
            assert np.array_equal(np.float32(probe[: len(want)]), want) and not any(probe[len(want) : KMAX]), t
            assert probe[KMAX:] == list(sources[p]), t
        else:
            assert not trace.confidence[p, trace.widths.index(2), : policy.probe[0]].any(), t
        probes += bool(probe)
        assert sess._choose(r) == policy.act(sess.observation(0, probe))
        top_k, layers = eng._obs_model  # the session's bound chooser is act_history's C++ path, the same object
        assert sess._chooser(r.history, t, r.max_new, 1, top_k, layers, probe) is policy.act_history(
            r.history, position=t, max_new_tokens=r.max_new, batch_size=1, top_k=top_k, num_moe_layers=layers,
            calibration=eng.calibration, probe=probe)  # fmt: skip
        sess.step()
        assert sess.requests[0].rounds[-1].probe_seconds > 0 or t >= n_new - 2
    out = sess.results()[0].token_ids
    assert 0 < len(sess._checked) <= np.prod(policy.nvec)  # each grid action validated once
    sess.close()
    assert probes > 0 and out == trace.continuation_of(req).tolist()
    assert eng.generate([prompt], n_new, policy=policy)[0].token_ids == out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smoke_run):
    """A frozen PPO policy trained for a few hundred steps on the smoke traces, and its SB3 model."""
    tmp, _, _ = smoke_run
    old = os.environ.get("EXPERTSPEC_CACHE")
    os.environ["EXPERTSPEC_CACHE"] = str(tmp / "cache")  # the smoke run's traces: nothing is recorded again
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="conf", version_base=None):
        conf = OmegaConf.to_object(compose(config_name="main", overrides=["+experiment=main_smoke"]))
    from ctrl.pipeline import record_traces

    traces = record_traces(conf)
    trace = traces["code"]
    grid = grid_of(conf)
    train_ids, _ = split(trace, conf)
    algo = AlgoConf(total_timesteps=256, n_envs=1, n_steps=64, batch_size=64, n_epochs=1)
    out = tmp_path_factory.mktemp("policy")
    acceptance = fit_acceptance_model(conf, {"code": trace})
    card = {"card": {"acceptance": acceptance.to_dict()}}  # the grid has the calibrated rule: its model rides along
    path, _ = train_policy(lambda r: replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance), grid,
                           algo, 0, out, WandbConf(mode="disabled"), card)  # fmt: skip
    yield conf, trace, grid, path, acceptance
    if old is None:
        os.environ.pop("EXPERTSPEC_CACHE", None)
    else:
        os.environ["EXPERTSPEC_CACHE"] = old


def test_frozen_policy_decides_like_the_env_and_the_engine(trained):
    conf, trace, grid, path, acceptance = trained
    policy = load_frozen_policy(path)
    env = replay_env(trace, conf.costs[0], grid, acceptance=acceptance)
    e = env.unwrapped
    vec, _ = e.reset(options={"request": 0})
    done = False
    while not done:  # the env's observation vector and the Observation object give the same decision
        obs = e.observation()
        assert np.array_equal(obs.vector(), vec)
        spec = policy.act(obs)
        assert grid.spec(policy.act_index(vec)) == spec
        assert (spec.acceptance == acceptance) if spec.verify_rule == "calibrated" else spec.acceptance is None
        vec, _, term, trunc, _ = e.step(e.codec.encode(policy.act_index(vec)))
        done = term or trunc
    import torch

    assert policy._mlp is not None  # SB3's MlpPolicy actor runs as its numpy twin
    rng = np.random.default_rng(0)
    for _ in range(50):
        v = rng.random(OBS_DIM).astype(np.float32)
        with torch.no_grad():
            ref = policy.module(torch.from_numpy(v[None]))[0].numpy()
        logits = policy.logits(v)
        np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=1e-5)
        ends = np.cumsum(policy.nvec)  # the padded one-argmax path == argmax per action dimension
        assert policy.act_index(v) == tuple(int(logits[e - n : e].argmax()) for n, e in zip(policy.nvec, ends))


def test_frozen_policy_native_actor_decides_like_its_numpy_twin(trained):
    """The C++ actor (kernels.tanh_mlp, float32) the engine and the env act through == the numpy twin (float64), on
    the observation vector and on its raw values (what the session passes): logits within float32's error, the same
    decisions but where a dimension's two best logits lie closer than that."""
    from kernels import tanh_mlp

    if tanh_mlp.load() is None:
        pytest.skip(f"C++ actor {tanh_mlp.status()}")
    policy = load_frozen_policy(path := trained[3])
    assert policy._native is not None, path
    m, rng, exact = policy._mlp, np.random.default_rng(1), 0
    for i in range(200):
        v = rng.random(OBS_DIM) if i % 2 else rng.normal(0.5, 1.0, OBS_DIM)  # raw values may leave [0, 1]
        twin = policy._mlp_logits(v)
        got, real = np.asarray(policy._native.logits(v.tolist())), np.isfinite(twin)
        np.testing.assert_allclose(got[real], twin[real], rtol=0, atol=1e-5)
        idx = policy.act_index(v.tolist())
        rows = twin.reshape(m.dims, -1)
        assert idx == policy.act_index(as_vector(v))
        assert all(rows[d, g] >= rows[d].max() - 1e-5 for d, g in enumerate(idx))
        exact += idx == tuple(rows.argmax(1).tolist())
    assert exact >= 198


def test_frozen_policy_vector_path_decides_like_its_observation_path(trained):
    """What the engine's session calls (act_vector on observation_vector) == act(Observation), on a live run."""
    _, _, _, path, _ = trained
    policy = load_frozen_policy(path)
    target = engine.load_model(zoo_path("tiny-moe"))
    from engine.workloads import encode, prose_prompts

    eng = engine.Engine(target, drafter=str(zoo_path("eagle-head")), predictor=str(zoo_path("expert-predictor")))
    sess = eng.start(encode(target.tokenizer, prose_prompts(3), 32), 24, policy=policy)
    chosen = 0
    while not sess.done:
        for rid in sess.active:
            r = sess.requests[rid]
            assert sess._choose(r) == policy.act(sess.observation(rid))
            chosen += 1
        sess.step()
    sess.close()
    assert chosen >= 6


def test_deployed_policy_is_exact_in_the_engine(trained):
    _, _, _, path, _ = trained
    target = engine.load_model(zoo_path("tiny-moe"))
    from engine.workloads import code_prompts, encode

    prompts = encode(target.tokenizer, code_prompts(2), 40)
    eng = engine.Engine(target, drafter=str(zoo_path("eagle-head")), predictor=str(zoo_path("expert-predictor")))
    base = [r.token_ids for r in eng.generate(prompts, 16)]
    assert [r.token_ids for r in eng.generate(prompts, 16, policy=str(path))] == base
    sampled = [engine.SamplingParams(temperature=0.8, seed=3 + i, mode="position") for i in range(2)]
    ref = [r.token_ids for r in eng.generate(prompts, 16, sampling=sampled)]
    assert [r.token_ids for r in eng.generate(prompts, 16, sampling=sampled, policy=str(path))] == ref


def test_policy_overhead_benchmark_smoke(trained, tmp_path):
    """`python -m engine.bench policy` on the trained artefact: every request-round timed, shares in (0, 1)."""
    from engine.bench.configs import BenchConfig
    from engine.bench.policy import bench_policy, print_policy

    _, _, _, path, _ = trained
    cfg = BenchConfig(mode="policy", new_tokens=6, prompt_len=24)
    cfg.policy_bench.path, cfg.policy_bench.workloads, cfg.policy_bench.num_prompts = str(path), ["code"], 2
    cfg.policy_bench.batch_sizes, cfg.policy_bench.repeats = [1, 2], 1
    res = bench_policy(cfg)
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["request_rounds"] >= 2 and r["policy_seconds_median"] > 0 and 0 < r["share_of_wall"] < 1
        assert r["plain_step_seconds_median"] > 0 and r["round_seconds_median"] > 0
    native = {"native_choose"} if tanh_mlp.load() is not None else set()  # the C++ choice, when it is built
    assert set(res["parts"]) == {"observation", "policy_call", "choice"} | native and min(res["parts"].values()) > 0
    print_policy(res)
    cfg.policy_bench.drafter, cfg.policy_bench.batch_sizes = "ngram", [1]  # the prompt-lookup drafter
    with pytest.raises(ValueError, match="predictor=null"):
        bench_policy(cfg)
    cfg.policy_bench.predictor = None
    assert bench_policy(cfg)["rows"][0]["request_rounds"] >= 2
    cfg.policy_bench.path = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not a frozen policy folder"):
        bench_policy(cfg)


def test_policy_from_another_observation_layout_is_refused(trained, tmp_path):
    import shutil

    _, _, _, path, _ = trained
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    card = json.loads((bad / "policy.json").read_text())
    card["obs_signature"] = "expertspec-obs-v0:000000000000"
    (bad / "policy.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="observation layout"):
        load_frozen_policy(bad)
    card["obs_signature"] = json.loads((path / "policy.json").read_text())["obs_signature"]
    card.pop("acceptance")  # a calibrated-rule grid without its acceptance model
    (bad / "policy.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="stores no acceptance model"):
        load_frozen_policy(bad)
    with pytest.raises(FileNotFoundError, match="not a frozen policy folder"):
        load_frozen_policy(tmp_path / "missing")


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_modes(trained, tmp_path, mode, monkeypatch):
    """W&B offline writes its run directory under the run's folder, disabled writes nothing; either way SB3 leaves
    no `SB3-<time>` folder in the temporary directory (its default logger's)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.delenv("SB3_LOGDIR", raising=False)
    conf, trace, grid, _, acceptance = trained
    train_ids, _ = split(trace, conf)
    algo = AlgoConf(total_timesteps=128, n_envs=1, n_steps=64, batch_size=64, n_epochs=1)
    train_policy(lambda r: replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance), grid, algo, 0,
                 tmp_path, WandbConf(mode=mode), {"card": {"acceptance": acceptance.to_dict()}})  # fmt: skip
    runs = list((tmp_path / "wandb").glob("offline-run-*")) if (tmp_path / "wandb").exists() else []
    if mode == "offline":
        assert runs, "an offline W&B run directory is written"
        import wandb

        wandb.teardown()  # the W&B service writes the run's records asynchronously: flush them
        record = next(runs[0].glob("run-*.wandb")).read_bytes()
        assert b"ppo-seed0" in record and b"policy" in record  # the frozen policy logged as an artifact
    else:
        assert not (tmp_path / "wandb").exists()
    assert not list(scratch.glob("SB3-*"))


def test_aggrevate_alone_is_evaluated_on_the_held_out_prompts_once(trained, tmp_path):
    """AggreVaTe never calls SB3's learn, so its held-out evaluation runs once on the fitted actor, and it equals
    the frozen policy's speed-up replayed by hand on the same requests."""
    conf, trace, grid, _, acceptance = trained
    train_ids, test_ids = split(trace, conf)
    algo = AlgoConf(name="aggrevate", iterations=1, epochs=2, n_envs=1, checkpoint_every=0, eval_every=1)
    history: list = []
    card = {"card": {"acceptance": acceptance.to_dict()}}
    path, _ = train_policy(lambda r: replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance), grid,
                           algo, 0, tmp_path, WandbConf(mode="disabled"), card,
                           make_eval_envs=lambda: {"code": replay_env(trace, conf.costs[0], grid, test_ids,
                                                                      acceptance=acceptance)},
                           held_out=history)  # fmt: skip
    assert [s for s, _ in history[0]] == [1]
    policy, env = load_frozen_policy(path), replay_env(trace, conf.costs[0], grid, test_ids, acceptance=acceptance)
    committed = cost = 0.0
    for req in test_ids:
        vec, _ = env.reset(options={"request": int(req)})
        done = False
        while not done:
            vec, _, term, trunc, info = env.step(env.unwrapped.codec.encode(policy.act_index(vec)))
            committed, cost, done = committed + info["committed"], cost + info["cost"] / info["cost_ar"], term or trunc
    assert history[0][0][1]["code"] == pytest.approx(committed / cost, rel=1e-9)


def test_training_hands_wandb_the_resolved_config(trained, tmp_path, monkeypatch):
    """ctrl.pipeline.train gives each W&B run the whole resolved job config (`main`), the learner's algo and the
    cost model, besides the card."""
    import ctrl.agent
    from ctrl.pipeline import train

    conf, trace, _, _, _ = trained
    seen = {}

    def fake(make_env, grid, algo, seeds, out_dir, wandb_conf, config, progress, make_eval_envs=None):
        seen.update(config=config, algo=algo)
        return ctrl.agent.TrainResult([], 0.0, {})

    monkeypatch.setattr(ctrl.agent, "train_seeds", fake)
    train(conf, {"code": trace}, conf.costs[0], tmp_path, learner="td3")
    from dataclasses import asdict

    assert seen["config"]["main"] == asdict(conf) and seen["config"]["algo"]["name"] == "td3"
    assert seen["config"]["cost"]["name"] == conf.costs[0].name and "acceptance" in seen["config"]["card"]


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_box_learners_train_checkpoint_evaluate_and_freeze(trained, tmp_path, name):
    """SAC / TD3 on the Box action: SB3 checkpoints every 128 steps, the held-out evaluation callback logs finite
    speed-ups, and the frozen artefact (tanh MLP + box_cells, run by the C++ actor) decides as the final
    checkpoint's deterministic action decoded by the env, on real observations and on random ones."""
    from stable_baselines3 import SAC, TD3
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    conf, trace, grid, _, acceptance = trained
    train_ids, test_ids = split(trace, conf)
    algo = AlgoConf(name=name, total_timesteps=256, n_envs=2, batch_size=64, learning_starts=64, eval_every=128,
                    checkpoint_every=128)  # fmt: skip
    card = {"card": {"acceptance": acceptance.to_dict()}}
    with pytest.raises(ValueError, match="trains on the box action space"):
        train_policy(lambda r: replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance), grid, algo, 0,
                     tmp_path, WandbConf(mode="disabled"), card)  # fmt: skip
    history: list = []
    path, _ = train_policy(
        lambda r: replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance, action_kind="box"),
        grid, algo, 0, tmp_path, WandbConf(mode="disabled"), card,
        make_eval_envs=lambda: {"code": replay_env(trace, conf.costs[0], grid, test_ids, acceptance=acceptance,
                                                   action_kind="box")},
        held_out=history,
    )  # fmt: skip
    steps = [s for s, _ in history[0]]
    assert steps == [128, 256] and all(np.isfinite(r["code"]) and r["code"] > 0 for _, r in history[0])
    ckpt = tmp_path / "checkpoints" / "seed0"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        f"{name}_{s}.zip" for s in ("128_steps", "256_steps", "final")) + sorted(
        f"{name}_vecnormalize_{s}.pkl" for s in ("128_steps", "256_steps", "final"))  # fmt: skip
    model = {"sac": SAC, "td3": TD3}[name].load(ckpt / f"{name}_final.zip", device="cpu")
    env = replay_env(trace, conf.costs[0], grid, test_ids, acceptance=acceptance, action_kind="box")
    vn = VecNormalize.load(str(ckpt / f"{name}_vecnormalize_final.pkl"), DummyVecEnv([lambda: env]))
    policy = load_frozen_policy(path)
    assert policy.card["algo"] == name and policy._native is not None  # the engine's plain tanh-MLP path
    codec = env.unwrapped.codec
    bounds = [-1 + 2 * np.arange(1, n) / n for n in codec.nvec]

    def same(v: np.ndarray) -> bool:
        x = model.predict(vn.normalize_obs(v[None]), deterministic=True)[0][0]
        if any(len(b) and np.min(np.abs(b - xi)) < 1e-5 for b, xi in zip(bounds, x)):
            return True  # within float rounding of a cell boundary: either cell is the same action's edge
        return policy.act_index(v) == codec.decode(x)

    rng = np.random.default_rng(1)
    assert all(same(rng.random(OBS_DIM).astype(np.float32)) for _ in range(200))
    vec, _ = env.reset(options={"request": int(test_ids[0])})
    done, steps = False, 0
    while not done:
        assert same(vec)
        vec, _, term, trunc, _ = env.step(codec.encode(policy.act_index(vec)))
        done, steps = term or trunc, steps + 1
    assert steps > 1


def test_subproc_vec_env_trains_the_same_policy(trained, tmp_path):
    """algo.vec_env=subproc (one spawned process per env) trains the policy DummyVecEnv does: same trajectories,
    weights equal to float rounding (DummyVecEnv buffers rewards in float32, SubprocVecEnv stacks float64)."""
    import torch

    conf, trace, grid, _, acceptance = trained
    train_ids, _ = split(trace, conf)
    weights = {}
    for vec_env in ("dummy", "subproc"):
        algo = AlgoConf(total_timesteps=128, n_envs=2, n_steps=64, batch_size=64, n_epochs=1, vec_env=vec_env,
                        checkpoint_every=0)  # fmt: skip
        path, _ = train_policy(lambda r: replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance),
                               grid, algo, 3, tmp_path / vec_env, WandbConf(mode="disabled"),
                               {"card": {"acceptance": acceptance.to_dict()}})  # fmt: skip
        weights[vec_env] = torch.jit.load(str(path / "policy.pt")).state_dict()
    assert weights["dummy"].keys() == weights["subproc"].keys()
    for k in weights["dummy"]:
        torch.testing.assert_close(weights["subproc"][k], weights["dummy"][k], rtol=0, atol=1e-6)


def test_configs_compose():
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import engine.zoo.configs  # noqa: F401  (registers the zoo / train_heads schemas)
    from env.record import _register

    _register()
    with initialize_config_module(config_module="conf", version_base=None):
        default = OmegaConf.to_object(compose(config_name="main"))
        smoke = OmegaConf.to_object(compose(config_name="main", overrides=["+experiment=main_smoke", "seeds=[4]"]))
        for name in ("record", "zoo", "train_heads"):
            assert compose(config_name=name) is not None
        for group in ("replay", "live"):
            assert compose(config_name=f"env/{group}")["env"]["_target_"].startswith("env.")
    assert isinstance(default, MainConf) and isinstance(smoke, MainConf)
    assert default.workloads.names == ["code", "prose", "chat", "math"] and len(default.seeds) >= 3
    assert smoke.seeds == [4] and smoke.algo.total_timesteps < default.algo.total_timesteps
    assert smoke.algo.learning_rate == default.algo.learning_rate  # presets change only what they name
    with initialize_config_module(config_module="conf", version_base=None):
        ngram = OmegaConf.to_object(compose(config_name="main", overrides=["+experiment=[main_smoke,ngram]"]))
    assert ngram.models.drafter == "ngram" and ngram.models.predictor is None and ngram.seeds == default.seeds[:1]
    check_conf(ngram)
    assert default.learners == ["aggrevate", "ppo"]  # ctrl=default, workload=builtin


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


def test_every_group_option_composes():
    """Every option of conf/ctrl, conf/workload and conf/hydra/launcher composes with the main config and (but the
    file workload, which needs its path) passes check_conf; each sets what it names."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    assert set(_group_options("ctrl")) >= {"default", "ppo", "aggrevate", "aggrevate_ppo", "sac", "td3"}
    assert set(_group_options("workload")) >= {"builtin", "code", "prose", "chat", "math", "sampled", "fastchat"}
    with initialize_config_module(config_module="conf", version_base=None):
        for opt in _group_options("ctrl"):
            conf = OmegaConf.to_object(compose(config_name="main", overrides=[f"ctrl={opt}"]))
            check_conf(conf)
            assert conf.algo.name == conf.learners[-1] or opt == "default"
        for opt in _group_options("workload"):
            conf = OmegaConf.to_object(compose(config_name="main", overrides=[f"workload={opt}"]))
            if opt == "fastchat":
                with pytest.raises(ValueError, match="no workload"):
                    check_conf(conf)
                conf.workloads.prompts = str(ROOT / "README.md")  # any existing file passes the path check
            else:
                check_conf(conf)
                assert set(conf.workloads.names) <= {"code", "prose", "chat", "math"} and conf.workloads.names
        sampled = OmegaConf.to_object(compose(config_name="main", overrides=["workload=sampled"]))
        assert sampled.workloads.temperature > 0
        launchers = {"local": "JoblibLauncher", "cluster": "SlurmLauncher"}
        assert set(_group_options("hydra/launcher")) == set(launchers)
        for opt, cls in launchers.items():
            cfg = compose(config_name="main", overrides=[f"hydra/launcher={opt}"], return_hydra_config=True)
            assert cfg.hydra.launcher._target_.endswith(cls)
        sweep = compose(config_name="main", overrides=["costs.0.hardware=h100", "grid.lams=[0.0,0.5]"])
    conf = OmegaConf.to_object(sweep)  # what a sweep over hardware profiles / λ grids sets per job
    assert conf.costs[0].hardware == "h100" and conf.grid.lams == [0.0, 0.5]
    check_conf(conf)


def test_every_experiment_composes_with_its_entry_point():
    """Each conf/experiment preset composes with the config it is for (a new preset must be added here)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import engine.zoo.configs  # noqa: F401  (registers the zoo schemas)

    owner = {"main_smoke": "main", "ngram": "main", "regimes": "main", "zoo_smoke": "zoo",
             "zoo_fine_smoke": "zoo_fine"}  # fmt: skip
    assert set(_group_options("experiment")) == set(owner)
    with initialize_config_module(config_module="conf", version_base=None):
        for exp, config in owner.items():
            conf = OmegaConf.to_object(compose(config_name=config, overrides=[f"+experiment={exp}"]))
            if config == "main":
                check_conf(conf)


@pytest.mark.slow
def test_multirun_sweep_with_the_local_launcher(smoke_run, tmp_path):
    """`python -m ctrl.train -m hydra/launcher=local ... seeds=[0],[1]`: two jobs in parallel processes, each
    freezing its own seed's policy per cost model in its own job folder."""
    tmp, _, _ = smoke_run
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "ctrl.train", "-m", "hydra/launcher=local", "+experiment=main_smoke", "ctrl=td3",
           "seeds=[0],[1]", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "JoblibLauncher" in proc.stdout + proc.stderr or "Joblib" in proc.stdout + proc.stderr
    for job, seed in (("0", 0), ("1", 1)):
        cards = sorted(c for c in (sweep / job).rglob("policy.json") if "variants" not in c.parts)
        assert len(cards) == 2, cards  # one per cost model (the kept probe variant; both under variants/)
        assert all(json.loads(c.read_text())["algo"] == "td3" and json.loads(c.read_text())["seed"] == seed
                   for c in cards)  # fmt: skip


def test_bad_configuration_fails_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ctrl", "nope=1"], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "nope" in proc.stderr
    conf = MainConf()
    conf.workloads.names = ["poetry"]
    with pytest.raises(ValueError, match="unknown workloads"):
        check_conf(conf)
    conf = MainConf()
    conf.costs[0].hardware = "tpu9"
    with pytest.raises((ValueError, FileNotFoundError), match="tpu9"):
        check_conf(conf)
    conf = MainConf()
    conf.policies = ["magic"]
    with pytest.raises(ValueError, match="unknown policy"):
        check_conf(conf)
    conf = MainConf()
    conf.learners = ["dqn"]
    with pytest.raises(ValueError, match="unknown learner"):
        check_conf(conf)
    conf = MainConf()
    conf.algo.expert = "human"
    with pytest.raises(ValueError, match="algo.expert"):
        check_conf(conf)
    conf = MainConf()
    conf.algo.imitation_entropy = -0.5
    with pytest.raises(ValueError, match="imitation_entropy"):
        check_conf(conf)
    conf = MainConf()
    conf.models.drafter = "ngram"  # the default expert predictor reads a model drafter's hidden states
    with pytest.raises(ValueError, match="predictor=null"):
        check_conf(conf)
    conf.models.predictor = None
    check_conf(conf)
    conf = MainConf()
    conf.workers = 0
    with pytest.raises(ValueError, match="workers must be >= 1"):
        check_conf(conf)
    for field, value, match in [("vec_env", "threads", "algo.vec_env"), ("buffer_size", 0, "algo.buffer_size"),
                                ("eval_every", -1, "algo.eval_every"), ("tau", 2.0, "algo.tau"),
                                ("name", "dqn", "algo.name"), ("net_arch", [64, 0], "algo.net_arch"),
                                ("gradient_steps", 0, "algo.gradient_steps")]:  # fmt: skip
        conf = MainConf()
        setattr(conf.algo, field, value)
        with pytest.raises(ValueError, match=match):
            check_conf(conf)
    conf = MainConf()
    conf.policy_path = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not a frozen policy folder"):
        check_conf(conf)
    assert not (tmp_path / "cache").exists()


def test_policy_from_another_action_grid_is_refused(trained):
    _, _, _, path, _ = trained
    conf = MainConf()  # the default grid, not the smoke grid the policy was trained on
    conf.policy_path = str(path)
    with pytest.raises(ValueError, match="acts on the grid"):
        check_conf(conf)


def test_policy_with_another_actor_width_is_refused(trained):
    """The recording prices the choice of a stand-in of `algo.net_arch`'s shape: a given policy of another width
    would be priced a choice that is not its own, so the evaluation names the option to set before any work."""
    conf, _, _, path, _ = trained
    conf = copy.deepcopy(conf)
    conf.policy_path = str(path)
    check_conf(conf)  # the policy's actor is the default [64, 64]: accepted
    conf.algo.net_arch = [32]
    with pytest.raises(ValueError, match=r"hidden layers are \[64, 64\].*set algo.net_arch=\[64,64\]"):
        check_conf(conf)
    conf.costs = [c for c in conf.costs if c.kind != "fitted"]  # the roofline prices any choice alike
    check_conf(conf)


def test_train_and_evaluate_entry_points(smoke_run):
    """`python -m ctrl.train` writes frozen policies; `python -m ctrl.evaluate policy_path=...` evaluates one."""
    tmp, _, _ = smoke_run
    run = tmp / "train_run"
    cmd = [sys.executable, "-m", "ctrl.train", "+experiment=main_smoke", "learners=[aggrevate]", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    policies = sorted(p for p in run.rglob("policy.json") if "variants" not in p.parts)
    assert len(policies) == 2  # one per cost model (one seed; the probe variants trained for it under variants/)
    ev = tmp / "eval_run"
    cmd = [sys.executable, "-m", "ctrl.evaluate", "+experiment=main_smoke", f"policy_path={policies[0].parent}",
           f"hydra.run.dir={ev}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((ev / "results.json").read_text())
    assert {"learned", "learned-seed0", "oracle"} <= {r["policy"] for r in rows}


def test_wallclock_entry_point(smoke_run):
    """`python -m ctrl.wallclock`: static-best-test and every cached learned seed deployed in the live engine,
    exact against target-only (checked inside), a speed-up per policy and workload; bad options fail first."""
    tmp, _, _ = smoke_run
    run = tmp / "wallclock_run"
    cmd = [sys.executable, "-m", "ctrl.wallclock", "+experiment=main_smoke", "wallclock.repeats=1",
           f"hydra.run.dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((run / "wallclock.json").read_text())
    assert res["cost"] == "measured-cpu" and set(res["workloads"]) == {"code", "prose"}
    for w in res["workloads"].values():
        assert (
            set(w["speedup"])
            == set(w["replay_speedup"])
            == {"static-best-test", "static-best-test-bare", "aggrevate-seed0", "ppo-seed0"}
        )
        assert all(0 < v < 100 for v in w["speedup"].values()) and w["target_only_seconds"] > 0
        # the same speed-ups over the tokens from wallclock.steady_from on (the first rounds after a prefill apart)
        assert set(w["steady_speedup"]) == set(w["replay_steady_speedup"]) == set(w["speedup"])
        assert all(0 < v < 100 for v in [*w["steady_speedup"].values(), *w["replay_steady_speedup"].values()])
    assert res["steady_from"] == 4 and "tokens from position 4 on" in proc.stdout  # main_smoke sets 4
    smoke = {(r["workload"], r["policy"]): r["speedup_vs_ar"] for r in json.loads((tmp / "run" / "results.json")
             .read_text()) if r["cost_model"] == "measured-cpu" and r["backend"] == "replay"}  # fmt: skip
    for wl, w in res["workloads"].items():  # the replay figures are the evaluation's, for the same policies
        assert w["replay_speedup"]["static-best-test"] == pytest.approx(smoke[wl, "static-best-test"], rel=1e-9)
    assert "speed-up over target-only decoding on the held-out prompts: wall clock" in proc.stdout
    for bad, msg in (("wallclock.cost=h100", "not one of costs"), ("wallclock.repeats=0", "repeats must be >= 1"),
                     ("wallclock.steady_from=-1", "steady_from must be in")):  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "ctrl.wallclock", "+experiment=main_smoke", bad,
                               f"hydra.run.dir={tmp / 'wc_bad'}"], cwd=tmp, env=_env(tmp), capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode != 0 and msg in proc.stderr


def test_aggrevate_static_expert_q(trained):
    """Q_s(t, a_s) is a_s's own return-to-go, so following a_s has zero regret against Q_s, and the best Q_s
    action at t = 0 is never worse than a_s (one policy-improvement step)."""
    from ctrl.aggrevate import best_static_action, oracle_q, static_q
    from env.oracle import static_returns

    conf, trace, grid, _, acceptance = trained
    train_ids, _ = split(trace, conf)
    env = replay_env(trace, conf.costs[0], grid, train_ids, acceptance=acceptance)
    a_s = best_static_action(env, train_ids)
    totals = sum(static_returns(env, i)[1] for i in train_ids)
    assert totals[a_s] == totals.min()
    for i in train_ids:
        q, q_star = static_q(env, i, a_s), oracle_q(env, i)
        ret, _ = static_returns(env, i)
        assert q[0, 0, a_s] == pytest.approx(ret[a_s])  # episode return of a_s from the first position, round 0
        assert q[0, 0].max() >= q[0, 0, a_s] and np.all(q_star >= q - 1e-9)  # the oracle's future is the best one


def test_aggrevate_q_rows_take_the_round_index_under_a_warm_up(trained, monkeypatch):
    """Under a cost with a warm-up surcharge (engine.cost.warmup) the expert's Q rows are [T, R + 1, A]: the oracle's
    best row at (0, 0) is its plan's value, and Q_s(0, 0, a) of a static action is its episode return as the env
    prices it, surcharges included."""
    from ctrl.aggrevate import oracle_q, static_q
    from engine.cost.warmup import WarmupCost
    from env.costs import FittedCostModel
    from env.oracle import plan, static_returns
    from env.replay import ReplayEnv

    monkeypatch.setattr(FittedCostModel, "warmup_cost", lambda self: WarmupCost((4e-4, 2e-4, 1e-4)))
    conf, trace, grid, _, acceptance = trained
    env = ReplayEnv(trace, grid=grid, cost={"kind": "fitted"}, cache=False, acceptance=acceptance)
    for i in range(min(3, trace.num_requests)):
        q = oracle_q(env, i)
        assert q.shape == (len(trace.positions_of(i)), 4, env.codec.num_actions)
        assert q[0, 0].max() == pytest.approx(plan(env, i, "return").best)
        ret, _ = static_returns(env, i)
        for a in {0, int(np.argmax(ret))}:
            assert static_q(env, i, a)[0, 0, a] == pytest.approx(ret[a])
            assert np.all(q >= static_q(env, i, a) - 1e-9)


def test_aggrevate_q_rows_take_the_previous_kind_under_a_switching_surcharge(trained, monkeypatch):
    """Under a cost with a switching surcharge (engine.cost.switching) and a warm-up, the expert's Q rows are
    [T, (R + 1)·3, A] (env.oracle.RoundStates): the oracle's best row at the first state is its plan's value, Q_s of a
    static action there its episode return as the env prices it, and the rows a collected state reads are its own."""
    from ctrl.aggrevate import oracle_q, static_q
    from engine.cost.switching import SwitchCost
    from engine.cost.warmup import WarmupCost
    from env.costs import FittedCostModel
    from env.oracle import plan, round_states, static_returns
    from env.replay import ReplayEnv

    monkeypatch.setattr(FittedCostModel, "warmup_cost", lambda self: WarmupCost((4e-4, 2e-4)))
    monkeypatch.setattr(FittedCostModel, "switch_cost", lambda self: SwitchCost(3e-4, 2e-4))
    conf, trace, grid, _, acceptance = trained
    env = ReplayEnv(trace, grid=grid, cost={"kind": "fitted"}, cache=False, acceptance=acceptance)
    states = round_states(env)
    assert states.size == 3 * 3 and states.kinds == 3
    for i in range(min(3, trace.num_requests)):
        q = oracle_q(env, i)
        assert q.shape == (len(trace.positions_of(i)), 9, env.codec.num_actions)
        assert q[0, 0].max() == pytest.approx(plan(env, i, "return").best)
        ret, _ = static_returns(env, i)
        a = int(np.argmax(ret))
        qs = static_q(env, i, a)
        assert qs[0, 0, a] == pytest.approx(ret[a]) and np.all(q >= qs - 1e-9)
        env.reset(options={"request": i})  # stepping a_s: Q_s at each visited state is the return still to come
        rewards, visited = [], []
        while True:
            visited.append((env.position, states.of_episode(env)))
            _, r, term, trunc, _ = env.step(env.codec.encode(env.codec.unflat(a)))
            rewards.append(r)
            if term or trunc:
                break
        togo = np.cumsum(rewards[::-1])[::-1]
        assert [qs[t, s, a] for t, s in visited] == pytest.approx(togo.tolist(), abs=1e-9)


def test_aggrevate_entropy_term_keeps_the_optimum_interior():
    """The expected regret is linear in π, so plain descent drives the logits apart without bound (saturation);
    with −α·H(π) they converge to π ∝ exp(−regret/α), the least-regret action first. Negative α is refused."""
    import torch

    from ctrl.aggrevate import aggrevate, regret_loss

    regret = torch.tensor([[0.0, 0.5, 2.0]])
    gaps = {}
    for alpha in (0.0, 0.5):
        z = torch.zeros(1, 3, requires_grad=True)
        opt = torch.optim.Adam([z], lr=0.1)
        for step in range(3000):
            opt.zero_grad()
            regret_loss(torch.log_softmax(z, dim=1), regret, alpha).backward()
            opt.step()
            if step in (1499, 2999):
                gaps.setdefault(alpha, []).append((z[0, 0] - z[0, 2]).item())
        p = torch.softmax(z, dim=1)[0].detach()
        assert int(p.argmax()) == 0
        if alpha > 0:
            assert torch.allclose(p, torch.softmax(-regret[0] / alpha, dim=0), atol=1e-3)
    assert gaps[0.0][1] > gaps[0.0][0] + 0.5 > 8  # still growing: no finite minimiser
    assert gaps[0.5] == pytest.approx([2.0 / 0.5] * 2, abs=0.05)  # converged to the regret gap / α
    with pytest.raises(ValueError, match="entropy"):
        aggrevate(None, [], [], entropy=-0.1)
