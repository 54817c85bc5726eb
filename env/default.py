"""The default trace of `gymnasium.make("expertspec/Replay-v0")`: recorded on first use, cached outside the repo.

Built-in mixed workload (8 prompts: stdlib code and pydoc prose), greedy, the shipped zoo pair (tiny-moe
target, EAGLE head + expert predictor), Kmax 8, widths 1..4, 64 new tokens: about 30 s on 2 CPU cores
once, then a cache hit under engine.paths.cache_dir()/traces.
"""

from __future__ import annotations

from functools import lru_cache

from env.record import RecordConf, WorkloadConf, record
from env.trace import Trace

DEFAULT_RECORD = RecordConf(workload=WorkloadConf(name="mixed", n=8), max_new_tokens=64, kmax=8, widths=[1, 2, 3, 4])


@lru_cache(maxsize=1)
def default_trace() -> Trace:
    """The default trace (recorded once per cache folder, loaded once per process)."""
    return record(DEFAULT_RECORD)
