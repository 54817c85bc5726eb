"""Shared fixtures of the env tests: the zoo models loaded once, small traces recorded once per session.

Traces are written to a session temp folder and replay tables are not cached (cache=False), so the tests
never touch the user's cache except the slow default-trace test.
"""

from __future__ import annotations

import pytest
import torch

from env.models import load_models
from env.record import RecordConf, SamplingConf, WorkloadConf, record

torch.set_num_threads(1)

TRACE_TOKENS = 24
SMALL_GRID = {
    "depths": [0, 1, 2, 4, 8],
    "widths": [1, 2, 3],
    "lams": [0.0],
    "rules": [["all", 0.0], ["threshold", 0.1]],
}


@pytest.fixture(scope="session")
def zoo_models():
    """(target, drafter, ModelInfo) of the shipped zoo pair: tiny-moe + EAGLE head + expert predictor."""
    return load_models("tiny-moe", "eagle-head", "expert-predictor")


def _conf(tmp, name: str, **kw) -> RecordConf:
    return RecordConf(
        max_new_tokens=TRACE_TOKENS,
        widths=[1, 2, 3],
        workload=WorkloadConf(name="mixed", n=2),
        out=str(tmp / f"{name}.npz"),
        calibrate_every=4,
        progress=False,
        **kw,
    )


@pytest.fixture(scope="session")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="session")
def greedy_trace(zoo_models, trace_dir):
    return record(_conf(trace_dir, "greedy"), models=zoo_models)


@pytest.fixture(scope="session")
def sampled_trace(zoo_models, trace_dir):
    return record(_conf(trace_dir, "sampled", sampling=SamplingConf(temperature=0.7, seed=3)), models=zoo_models)


@pytest.fixture(scope="session")
def ngram_models():
    """(target, drafter, ModelInfo): tiny-moe with the model-free prompt-lookup drafter."""
    return load_models("tiny-moe", "ngram", None)


@pytest.fixture(scope="session")
def ngram_trace(ngram_models, trace_dir):
    conf = RecordConf(max_new_tokens=TRACE_TOKENS, widths=[1, 2, 3], workload=WorkloadConf(name="code", n=2),
                      out=str(trace_dir / "ngram.npz"), calibrate_every=4, progress=False)  # fmt: skip
    return record(conf, models=ngram_models)
