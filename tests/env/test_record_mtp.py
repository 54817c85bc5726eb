"""Traces on the fine-grained zoo target (zoo/tiny-moe-fine, deepseek_v3) with its own MTP module: drafter="mtp"."""

from __future__ import annotations

import pytest

import engine
from env.models import load_models
from env.record import RecordConf, WorkloadConf, record
from env.trace import load_trace


def test_record_a_tiny_trace_with_the_targets_own_mtp_module(tmp_path):
    conf = RecordConf(target="tiny-moe-fine", drafter="mtp", predictor=None, kmax=3, widths=[1, 2], max_new_tokens=6,
                      workload=WorkloadConf(name="mixed", n=2), calibrate_every=2, out=str(tmp_path / "fine.npz"),
                      progress=False)  # fmt: skip
    trace = record(conf)  # models resolved by name through env.models.load_models
    target, _, info = load_models("tiny-moe-fine", "mtp", None)
    assert info.drafter_name == "mtp" and info.drafter_path == info.target_path
    drafter_meta = trace.meta["drafter"]
    assert drafter_meta["name"] == "mtp" and drafter_meta["digest"] == info.drafter_digest
    assert trace.meta["target"]["model_type"] == "deepseek_v3" and trace.num_experts == 64 and trace.top_r == 6
    assert trace.num_moe_layers == len(target.moe_blocks)
    eng = engine.Engine(target)
    for i in range(trace.num_requests):
        res = eng.generate([trace.prompt(i).tolist()], 6, eos_token_id=0)[0]
        assert res.token_ids == trace.continuation_of(i).tolist()
    assert load_trace(tmp_path / "fine.npz", info.target_digest, info.drafter_digest).digest == trace.digest


def test_mtp_drafter_on_a_target_without_mtp_is_a_clear_error():
    with pytest.raises(ValueError, match="deepseek_v3 / glm4_moe"):
        load_models("tiny-moe", "mtp", None)
