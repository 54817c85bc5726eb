"""Recording with worker processes (env.record_pool): the same traces as one process, progress for every
position, an interrupted run resumes from its shards, bad input fails before any work."""

from __future__ import annotations

import numpy as np
import pytest

from env.record import RecordConf, SamplingConf, WorkloadConf, record
from env.record_pool import record_many

SECONDS = {
    "target_seconds",
    "draft_seconds",
    "cal_target_seconds",
    "cal_draft_seconds",
    "cal_live_draft_seconds",
    "cal_live_forward_seconds",
    "cal_live_host_seconds",
    "cal_live_probe_seconds",
    "cal_live_policy_seconds",
    "probe_seconds",
}  # measured: may differ


def _confs(tmp, tag: str) -> list[RecordConf]:
    common = dict(max_new_tokens=5, widths=[1, 2], kmax=3, calibrate_every=2, progress=False)
    return [
        RecordConf(workload=WorkloadConf(name="code", n=3), out=str(tmp / f"{tag}-code.npz"), **common),
        RecordConf(workload=WorkloadConf(name="prose", n=2), out=str(tmp / f"{tag}-prose.npz"),
                   sampling=SamplingConf(temperature=0.8, seed=5), **common),
    ]  # fmt: skip


def _same_but_seconds(a, b) -> None:
    assert a.meta["key"] == b.meta["key"]
    for k in a.arrays:
        if k not in SECONDS:
            assert np.array_equal(a.arrays[k], b.arrays[k]), k
    assert {k for k in SECONDS if a.arrays[k].shape != b.arrays[k].shape} == set()


def test_two_workers_record_what_one_process_records(zoo_models, tmp_path):
    one = [record(c, models=zoo_models) for c in _confs(tmp_path, "one")]
    ticks = []
    two = record_many(_confs(tmp_path, "two"), workers=2, models=zoo_models, on_position=lambda: ticks.append(1))
    for a, b in zip(one, two):
        _same_but_seconds(a, b)
    assert len(ticks) == sum(t.num_positions for t in two)  # the worker's positions reach this process's bar
    again = record_many(_confs(tmp_path, "two"), workers=2, models=zoo_models, on_position=lambda: ticks.append(1))
    assert [t.digest for t in again] == [t.digest for t in two] and len(ticks) == sum(t.num_positions for t in two)


def test_an_interrupted_pool_keeps_its_shards_and_resumes(zoo_models, tmp_path):
    confs = _confs(tmp_path, "int")
    calls = []

    def boom():
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        record_many(confs, workers=2, models=zoo_models, on_position=boom)
    assert list((tmp_path / "int-code.parts").glob("req-*.npz"))  # finished requests kept
    assert not (tmp_path / "int-code.npz").exists()  # nothing half-written
    resumed = record_many(confs, workers=2, models=zoo_models)
    for a, b in zip([record(c, models=zoo_models) for c in _confs(tmp_path, "ref")], resumed):
        _same_but_seconds(a, b)


def test_bad_pool_input_fails_before_work(zoo_models, tmp_path):
    with pytest.raises(ValueError, match="workers must be >= 1"):
        record_many(_confs(tmp_path, "bad"), workers=0, models=zoo_models)
    mixed = _confs(tmp_path, "bad")
    mixed[1].drafter = "tiny-dense"
    with pytest.raises(ValueError, match="one \\(target, drafter, predictor\\)"):
        record_many(mixed, workers=2, models=zoo_models)
    assert not list(tmp_path.iterdir())
