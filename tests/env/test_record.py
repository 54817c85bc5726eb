"""Recording: the continuation is the target's own, interrupted recordings resume, bad input fails early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import engine
from env.host_calibration import HostCalibrator
from env.models import ModelInfo
from env.record import RecordConf, SamplingConf, WorkloadConf, record, trace_key
from env.trace import load_trace

REPO = Path(__file__).resolve().parents[2]


def test_continuation_is_target_only_decoding(greedy_trace, sampled_trace, zoo_models):
    target = zoo_models[0]
    eng = engine.Engine(target)
    for tr in (greedy_trace, sampled_trace):
        s = tr.meta["sampling"]
        for i in range(tr.num_requests):
            params = engine.SamplingParams()
            if s["temperature"] > 0:
                params = engine.SamplingParams(temperature=s["temperature"], seed=s["seed"] + i, mode="position")
            res = eng.generate([tr.prompt(i).tolist()], tr.meta["max_new_tokens"], sampling=params, eos_token_id=0)[0]
            assert res.token_ids == tr.continuation_of(i).tolist()
            assert bool(tr.finish_eos[i]) == (res.finish_reason == "eos")


def test_resume_after_interruption_keeps_finished_requests(zoo_models, tmp_path):
    conf = RecordConf(
        max_new_tokens=6,
        widths=[1, 2],
        kmax=4,
        workload=WorkloadConf(n=2),
        out=str(tmp_path / "r.npz"),
        calibrate_every=0,
    )
    calls = []

    def boom():
        calls.append(1)
        if len(calls) == 8:  # inside the second request
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        record(conf, models=zoo_models, on_position=boom)
    assert (tmp_path / "r.parts" / "req-00000.npz").is_file() and not (tmp_path / "r.npz").exists()
    calls.clear()
    resumed = []
    trace = record(
        conf,
        models=zoo_models,
        on_position=lambda: resumed.append(1),
        on_start=lambda n, d: resumed.append(("start", n, d)),
    )
    assert resumed[0] == ("start", 2, 1)  # one request resumed from its shard
    assert len(resumed) - 1 == len(trace.positions_of(1))  # only the second request was recorded again
    assert not (tmp_path / "r.parts").exists()
    assert record(conf, models=zoo_models).digest == trace.digest  # a finished trace is a cache hit


def test_bad_input_fails_before_work(zoo_models, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no usable prompts"):
        record(RecordConf(workload=WorkloadConf(prompts=str(empty)), out=str(tmp_path / "x.npz")), models=zoo_models)
    with pytest.raises(ValueError, match="mode=position"):
        record(RecordConf(sampling=SamplingConf(temperature=0.7, mode="generator")), models=zoo_models)
    with pytest.raises(ValueError, match="widths"):
        record(RecordConf(widths=[0]), models=zoo_models)
    with pytest.raises(ValueError, match="policy_hidden"):
        record(RecordConf(policy_hidden=[64, 0]), models=zoo_models)


def test_the_stand_in_has_the_learned_actors_layers(zoo_models):
    """The timed live rounds pay the choice of a stand-in with `policy_hidden` layers (the main job's
    `algo.net_arch`); another shape is another trace, the default keys as before."""
    target, drafter = zoo_models[0], zoo_models[1]
    for hidden in [(64, 64), (128, 32, 16)]:
        host = HostCalibrator(target, drafter, 4, [1, 2], 0, hidden)
        assert [w.shape[0] for w, _ in host.chooser._mlp.hidden] == list(hidden)
    info = ModelInfo("t", "a", "d", None, "b", None, None)
    prompts = [[1, 2, 3]]
    base = trace_key(RecordConf(), info, prompts)
    assert trace_key(RecordConf(policy_hidden=[64, 64]), info, prompts) == base
    assert trace_key(RecordConf(policy_hidden=[128, 128]), info, prompts) != base
    # without timed live rounds the stand-in prices nothing: the same trace
    off = trace_key(RecordConf(calibrate_every=0), info, prompts)
    assert trace_key(RecordConf(calibrate_every=0, policy_hidden=[128, 128]), info, prompts) == off


def test_fastchat_jsonl_workload(zoo_models, tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(
        '{"question_id": 1, "category": "writing", "turns": ["Write a haiku about experts."]}\n'
        '{"prompt": "def add(a, b):\\n    return"}\n'
    )
    conf = RecordConf(
        max_new_tokens=4,
        widths=[1],
        kmax=2,
        workload=WorkloadConf(prompts=str(q), n=8),
        out=str(tmp_path / "q.npz"),
        calibrate_every=0,
    )
    trace = record(conf, models=zoo_models)
    assert trace.num_requests == 2 and trace.meta["workload"]["source"] == str(q)


def test_record_entry_point_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), EXPERTSPEC_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "cli.npz"
    cmd = [
        sys.executable,
        "-m",
        "env.record",
        "max_new_tokens=3",
        "kmax=2",
        "widths=[1,2]",
        "workload.n=1",
        "calibrate_every=0",
        f"out={out}",
        "progress=false",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 requests" in proc.stdout
    assert load_trace(out).num_requests == 1


def test_prompt_lookup_drafter_records_and_replays(tmp_path):
    """drafter "ngram": the trace holds the target's own continuation and, at every position, exactly the
    prompt-lookup trees the engine's NGramDrafter drafts; replay prices them with the host-only lookup spec."""
    from engine.drafting.suffix import suffix_continuations
    from engine.runtime.action_grid import ActionGrid
    from engine.spec.config import SpecConfig
    from env.models import NGRAM_DIGEST, load_models
    from env.replay import ReplayEnv

    with pytest.raises(ValueError, match="predictor"):
        load_models("tiny-moe", "ngram", "expert-predictor")
    models = load_models("tiny-moe", "ngram", None)
    assert models[2].drafter_name == "ngram" and models[2].drafter_digest == NGRAM_DIGEST
    conf = RecordConf(max_new_tokens=24, widths=[1, 2], kmax=4, workload=WorkloadConf(name="code", n=2),
                      out=str(tmp_path / "ng.npz"), calibrate_every=4, progress=False)  # fmt: skip
    trace = record(conf, models=models)
    eng = engine.Engine(models[0])
    drafted = 0
    for i in range(trace.num_requests):
        prompt, cont = trace.prompt(i).tolist(), trace.continuation_of(i).tolist()
        assert eng.generate([prompt], 24)[0].token_ids == cont
        for t, p in enumerate(trace.positions_of(i)):
            depth = min(conf.kmax, conf.max_new_tokens - t - 1)
            for w, W in enumerate(trace.widths):
                nodes = trace.tree_nodes[trace.tree_offsets[p * len(trace.widths) + w] : trace.tree_offsets[
                    p * len(trace.widths) + w + 1]].astype(int) + trace.node_offsets[p]  # fmt: skip
                tok, par = trace.node_token[nodes].tolist(), trace.node_parent[nodes].tolist()
                paths = {}
                for j in range(1, len(nodes)):
                    paths[j] = paths.get(int(np.flatnonzero(nodes - trace.node_offsets[p] == par[j])[0]), ()) + (
                        tok[j],)  # fmt: skip
                leaves = {v for v in paths.values() if not any(o != v and o[: len(v)] == v for o in paths.values())}
                want = suffix_continuations(prompt + cont[:t], depth, W, select_depth=16) if depth > 0 else []
                assert leaves == {tuple(c) for c in want}
                drafted += len(nodes) - 1
    assert drafted > 0  # the lookup found continuations to draft
    grid = ActionGrid(depths=tuple(range(5)), widths=(1, 2), lams=(0.0,), rules=(("all", 0.0),))
    env = ReplayEnv(trace, grid=grid, cost={"kind": "roofline", "hardware": "h200", "model_spec": "qwen3_30b_a3b"})
    assert env.cost_model.drafter.spec.kind == "lookup"
    host = env.cost_model.drafter.spec.host_seconds
    assert env.cost_model.draft(4, 2, False, 10) == host and env.cost_model.draft(0, 1, False, 10) == 0.0
    vec, _ = env.reset(options={"request": 0})
    _, reward, *_ = env.step(env.codec.encode(grid.index(SpecConfig(depth=4, width=1))))
    assert np.isfinite(reward)
