"""Record several workloads' traces with worker processes: every process records its share of the requests.

    traces = record_many([conf_code, conf_prose], workers=2, on_position=bar.update)

Process r of `workers` records the requests i with i % workers == r of every workload that is not cached yet
(`env.record.record(..., rank=r, world_size=workers, merge=False)`: one shard per finished request); this
process is rank 0, the others are spawned (one intra-op thread each). Once every shard exists this process
merges each trace (`record`, which finds them all done) and returns them in `confs` order. A second run finds
the traces cached and spawns nothing. Shards are content-keyed files, so the trace equals a one-process
recording except for its measured seconds; a failed worker leaves its finished shards, and a rerun resumes.

The measured seconds (verification, drafting, calibration samples) are then taken with every core busy: on
this machine's two cores that shifts the fitted CPU cost by the figures the README records; `workers=1`
keeps them single-process.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any

from env.models import load_models
from env.record import RecordConf, record, recorded_trace
from env.trace import Trace


def _worker(confs: list[RecordConf], rank: int, world: int, counter: Any) -> None:
    first = confs[0]
    models = load_models(first.target, first.drafter, first.predictor)

    def tick() -> None:
        with counter.get_lock():
            counter.value += 1

    for conf in confs:
        record(conf, models=models, on_position=tick, rank=rank, world_size=world, merge=False)


def record_many(
    confs: Sequence[RecordConf],
    workers: int = 1,
    models: tuple[Any, Any, Any] | None = None,
    on_position: Callable[[], None] | None = None,
) -> list[Trace]:
    """Every conf's trace (same models in all), recorded with `workers` processes (module docstring)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not confs:
        return []
    if len({(c.target, c.drafter, c.predictor) for c in confs}) != 1:
        raise ValueError("record_many records one (target, drafter, predictor) triple; got several")
    first = confs[0]
    models = models if models is not None else load_models(first.target, first.drafter, first.predictor)
    found = [recorded_trace(c, models) for c in confs]  # cached traces are loaded once, here
    todo = [c for c, t in zip(confs, found) if t is None]
    tick = on_position or (lambda: None)
    if workers > 1 and todo:
        ctx = mp.get_context("spawn")  # never fork a process that holds torch's thread pools
        counter = ctx.Value("q", 0)
        procs = [ctx.Process(target=_worker, args=(todo, r, workers, counter), name=f"record-rank{r}")
                 for r in range(1, workers)]  # fmt: skip
        for p in procs:
            p.start()
        seen = 0

        def drain() -> None:  # the workers' positions into this process's progress callback
            nonlocal seen
            n = counter.value
            for _ in range(n - seen):
                tick()
            seen = n

        def mine() -> None:
            tick()
            drain()

        try:
            for conf in todo:
                record(conf, models=models, on_position=mine, rank=0, world_size=workers, merge=False)
            while any(p.is_alive() for p in procs):
                for p in procs:
                    p.join(timeout=0.2)
                drain()
        finally:
            for p in procs:
                if p.is_alive():  # this process failed: do not leave the workers recording
                    p.terminate()
                    p.join()
        drain()
        failed = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"recording workers failed (name, exit code): {failed}; their finished requests are "
                               "kept as shards, and a rerun resumes from them")  # fmt: skip
    # the others: merge their shards (workers > 1) or record them here
    return [t if t is not None else record(c, models=models, on_position=on_position) for c, t in zip(confs, found)]
