"""`python -m env.record`: record replay traces of a workload (env.trace describes the format).

    python -m env.record                                     # built-in mixed workload, greedy, zoo models
    python -m env.record workload.prompts=questions.jsonl    # FastChat / HumanEval-style JSONL
    python -m env.record sampling.temperature=0.7            # seeded drafter-invariant sampling (mode position)
    python -m env.record target=tiny-moe-fine drafter=mtp predictor=null   # fine-grained target, its own MTP

Every request is recorded position by position by env.request_recorder (the union of the grid's trees,
one tree-attention verification of it, the continuation's next token, calibration timings); this module
holds the configuration, the workload's prompts, the cache and the Hydra entry point.

Caching and resumption: traces live under engine.paths.cache_dir()/traces, named by a digest of
everything that determines them (models, sampling, grid, prompt tokens, budget). Each finished request
is written at once as a shard (<name>.parts/req-00007.npz); a rerun skips shards already there and the
final merge writes <name>.npz atomically, then drops the shards. Sampling in the generator mode is not
replayable exactly and is refused (use mode=position).

Sharding: under torchrun each rank records the requests i with i % WORLD_SIZE == RANK (its own shards),
and rank 0 merges after a gloo barrier.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.drafting.ngram import NGramDrafter
from engine.drafting.protocol import MAX_TREE_NODES
from engine.paths import cache_dir
from engine.runtime.frozen import STAND_IN_HIDDEN
from engine.spec.config import MAX_DEPTH, MAX_WIDTH
from engine.spec.sampling import SamplingParams
from engine.workloads import encode, workload
from env.host_calibration import HostCalibrator
from env.models import ModelInfo, load_models
from env.request_recorder import RequestRecorder
from env.trace import (
    ARRAYS,
    FORMAT_VERSION,
    Trace,
    TraceError,
    atomic_write_bytes,
    concat_parts,
    load_trace,
    make_trace,
    save_trace,
)


@dataclass
class WorkloadConf:
    name: str = "mixed"  # code | prose | mixed (engine.workloads), ignored when `prompts` is set
    n: int = 8  # requests
    prompts: str | None = None  # FastChat / HumanEval-style JSONL path


@dataclass
class SamplingConf:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # request i uses seed + i (position mode)
    mode: str = "position"  # the only replayable sampling mode


@dataclass
class RecordConf:
    """What a trace is recorded from (also the Hydra schema of conf/record.yaml)."""

    target: str = "tiny-moe"
    drafter: str = "eagle-head"
    predictor: str | None = "expert-predictor"  # None: no predicted experts (λ > 0 not replayable)
    kmax: int = 8
    widths: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    max_new_tokens: int = 64
    max_prompt_tokens: int = 128
    eos: bool = True  # stop a request at the tokenizer's end-of-text token (id 0 in the zoo)
    calibrate_every: int = 8  # 0: no calibration samples (no fitted cost model)
    # the hidden layers of the stand-in whose choice the timed live rounds pay (env.host_calibration): the learned
    # actor's (`algo.net_arch` of the main job), so the measured cost prices the choice of the policy it trains
    policy_hidden: list[int] = field(default_factory=lambda: list(STAND_IN_HIDDEN))
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    sampling: SamplingConf = field(default_factory=SamplingConf)
    out: str | None = None  # a trace path; None: the cache (engine.paths.cache_dir()/traces)
    progress: bool = True
    threads: int = 1


def check_layer_widths(hidden: Sequence[int], option: str) -> None:
    """ValueError naming `option` unless `hidden` is a non-empty list of positive layer widths (an actor's hidden
    layers: the stand-in's, RecordConf.policy_hidden, are the learned actor's, `algo.net_arch`)."""
    widths = list(hidden)
    if not widths or any(not isinstance(h, int) or h < 1 for h in widths):
        raise ValueError(f"{option} must be a non-empty list of positive layer widths, got {widths}")


def check_conf(conf: RecordConf) -> None:
    """ValueError for a grid or sampling the recorder cannot serve, before any model is loaded."""
    if not 1 <= conf.kmax <= min(MAX_DEPTH, 8):
        raise ValueError(f"kmax must be in 1..8 (the observation's KMAX), got {conf.kmax}")
    ws = list(conf.widths)
    if not ws or any(not 1 <= w <= MAX_WIDTH for w in ws) or len(set(ws)) != len(ws) or len(ws) > 16:
        raise ValueError(f"widths must be distinct ints in 1..{MAX_WIDTH}, got {ws}")
    if conf.kmax * max(ws) > MAX_TREE_NODES:
        raise ValueError(f"kmax * max(widths) = {conf.kmax * max(ws)} exceeds the drafter's {MAX_TREE_NODES} nodes")
    check_layer_widths(conf.policy_hidden, "policy_hidden")
    if conf.max_new_tokens < 1 or conf.max_prompt_tokens < 2:
        raise ValueError("max_new_tokens must be >= 1 and max_prompt_tokens >= 2")
    s = conf.sampling
    SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=max(s.seed, 0), mode=s.mode)
    if s.temperature > 0 and s.mode != "position":
        raise ValueError(
            "sampled traces replay exactly only with drafter-invariant sampling: set sampling.mode=position "
            f"(got mode={s.mode!r}); or record greedy (sampling.temperature=0)"
        )


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(conf: RecordConf, tokenizer) -> tuple[list[list[int]], str]:
    """Token ids of the workload's prompts (>= 2 tokens each) and a short workload name."""
    w = conf.workload
    prompts = workload(w.name, w.n, w.prompts)
    ids = encode(tokenizer, prompts, conf.max_prompt_tokens)
    usable = [p for p in ids if len(p) >= 2]
    source = w.prompts or w.name
    if not usable:
        raise ValueError(f"workload {source!r} has no usable prompts (need at least one prompt of >= 2 tokens)")
    slug = Path(w.prompts).stem if w.prompts else w.name
    return usable, re.sub(r"[^A-Za-z0-9_.-]+", "_", slug)


def trace_key(conf: RecordConf, info: ModelInfo, prompts: list[list[int]]) -> str:
    """Digest of everything that determines a trace (the cache file name)."""
    blob = {
        "format_version": FORMAT_VERSION,
        "target": info.target_digest,
        "drafter": [info.drafter_name, info.drafter_digest, info.predictor_digest],
        "kmax": conf.kmax,
        "widths": list(conf.widths),
        "max_new_tokens": conf.max_new_tokens,
        "eos": conf.eos,
        "calibrate_every": conf.calibrate_every,
        "sampling": asdict(conf.sampling) if conf.sampling.temperature > 0 else {"temperature": 0.0},
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }
    if conf.calibrate_every > 0 and tuple(conf.policy_hidden) != STAND_IN_HIDDEN:  # the default keys as before
        blob["policy_hidden"] = list(conf.policy_hidden)
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def default_trace_path(slug: str, key: str) -> Path:
    return cache_dir() / "traces" / f"{slug}-{key}.npz"


# ---------------------------------------------------------------------------------------------- a workload
def _save_part(path: Path, part: dict[str, np.ndarray]) -> None:
    import io

    buf = io.BytesIO()
    np.savez(buf, **part)
    atomic_write_bytes(path, buf.getvalue())


def _load_part(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            part = {k: z[k] for k in z.files}
    except (OSError, ValueError):
        return None  # a torn shard (cannot happen with atomic writes, but never trust it): record it again
    return part if set(part) == set(ARRAYS) else None


def _locate(conf: RecordConf, target, drafter, info: ModelInfo, prompts: Sequence[Sequence[int]] | None = None):
    """(prompt token ids, workload slug, trace key, trace path) of a recording; clear errors for a drafter that
    cannot record."""
    if drafter is None:
        raise ValueError("recording needs a drafter (a feature-head or dense drafter folder, or ngram)")
    model_free = isinstance(drafter, NGramDrafter)  # deterministic prompt lookup records as a model drafter does
    if getattr(drafter, "model", None) is None and not hasattr(drafter, "head") and not model_free:
        raise ValueError(f"recording needs a model drafter with deterministic children, got {type(drafter).__name__}")
    if prompts is None:
        prompt_ids, slug = load_prompts(conf, target.tokenizer)
    else:
        prompt_ids, slug = [list(map(int, p)) for p in prompts], "prompts"
        if not prompt_ids or any(len(p) < 2 for p in prompt_ids):
            raise ValueError("prompts must be a non-empty list of token lists with >= 2 tokens each")
    key = trace_key(conf, info, prompt_ids)
    return prompt_ids, slug, key, Path(conf.out) if conf.out else default_trace_path(slug, key)


def _cached(out: Path, key: str, info: ModelInfo) -> Trace | None:
    if out.is_file():
        try:
            trace = load_trace(out, info.target_digest, info.drafter_digest)
            if trace.meta.get("key") == key:
                return trace
        except TraceError:
            pass  # another format or model: record again
    return None


def recorded_trace(conf: RecordConf, models: tuple[Any, Any, ModelInfo]) -> Trace | None:
    """`conf`'s trace if it is already in the cache (or at conf.out) for these models, else None."""
    check_conf(conf)
    target, drafter, info = models
    _, _, key, out = _locate(conf, target, drafter, info)
    return _cached(out, key, info)


def record(
    conf: RecordConf,
    models: tuple[Any, Any, ModelInfo] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    on_position: Callable[[], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
    merge: bool = True,
) -> Trace:
    """Record (or load from the cache) the trace of `conf`'s workload; see the module docstring.

    models: (target, drafter, ModelInfo) already loaded (default: env.models.load_models of conf);
    prompts: token ids instead of conf.workload. on_start(num_requests, done): called once before
    recording; on_position(): after every recorded position (progress bars). rank / world_size: record
    only requests i with i % world_size == rank (torchrun sharding; rank 0 merges once every shard exists);
    merge=False: only record this rank's shards and return None (env.record_pool merges afterwards).
    """
    check_conf(conf)
    torch.set_num_threads(max(1, conf.threads))
    target, drafter, info = models if models is not None else load_models(conf.target, conf.drafter, conf.predictor)
    prompt_ids, slug, key, out = _locate(conf, target, drafter, info, prompts)
    trace = _cached(out, key, info)
    if trace is not None:
        return trace
    parts_dir = out.with_suffix(".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    eos = None
    if conf.eos and target.tokenizer is not None:
        eos = target.tokenizer.token_to_id("<|endoftext|>")
    lam_record = 1.0 if getattr(drafter, "predicts_experts", False) else 0.0
    s = conf.sampling
    mine = [i for i in range(len(prompt_ids)) if i % world_size == rank]
    done = [i for i in mine if _load_part(parts_dir / f"req-{i:05d}.npz") is not None]
    if on_start is not None:
        on_start(len(mine), len(done))
    host = None  # live rounds timed for the host-work term (env.host_calibration), with the calibration samples
    for i in mine:
        if i in done:
            continue
        seed = s.seed + i if s.temperature > 0 else -1
        params = SamplingParams(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed if seed >= 0 else None, mode=s.mode
        )
        part = RequestRecorder(target, drafter, conf, prompt_ids[i], params, eos, lam_record, seed).run(on_position)
        if conf.calibrate_every > 0:
            host = host or HostCalibrator(target, drafter, conf.kmax, list(conf.widths), eos, tuple(conf.policy_hidden))
            part.update(host.run(prompt_ids[i], conf.max_new_tokens, params))
        else:
            part.update(HostCalibrator.empty())
        _save_part(parts_dir / f"req-{i:05d}.npz", part)
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's shards are written before rank 0 merges
    if rank != 0 or not merge:
        return None  # type: ignore[return-value]
    parts = [_load_part(parts_dir / f"req-{i:05d}.npz") for i in range(len(prompt_ids))]
    if any(p is None for p in parts):
        missing = [i for i, p in enumerate(parts) if p is None]
        raise TraceError(f"shards of requests {missing} are missing in {parts_dir}: run the other ranks / rerun")
    meta = {
        "key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workload": {
            "name": slug,
            "source": conf.workload.prompts or conf.workload.name,
            "n": len(prompt_ids),
            "max_prompt_tokens": conf.max_prompt_tokens,
        },
        "target": info.target_meta(target),
        "drafter": info.drafter_meta(),
        "sampling": asdict(s) if s.temperature > 0 else {"temperature": 0.0, "mode": "greedy"},
        "grid": {"kmax": conf.kmax, "widths": list(conf.widths), "predicted_experts": lam_record > 0},
        "max_new_tokens": conf.max_new_tokens,
        "eos_token_id": eos,
        "calibrate_every": conf.calibrate_every,
        "torch": torch.__version__,
    }
    trace = make_trace(meta, concat_parts(parts))  # type: ignore[arg-type]
    save_trace(trace, out)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return trace


# ---------------------------------------------------------------------------------------------- entry point
def _register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="record_schema", node=RecordConf)


def main() -> None:
    import hydra
    from omegaconf import OmegaConf
    from tqdm import tqdm

    from engine.cli import quiet_hydra_argv

    _register()
    quiet_hydra_argv()

    @hydra.main(config_path="../conf", config_name="record", version_base=None)
    def run(cfg) -> None:
        conf: RecordConf = OmegaConf.to_object(cfg)
        bar = tqdm(total=0, desc="record", unit="pos", dynamic_ncols=True, disable=not conf.progress)

        def on_start(n: int, done: int) -> None:
            bar.total = (n - done) * conf.max_new_tokens
            bar.set_postfix(requests=n, resumed=done)
            bar.refresh()

        rank, world = _dist_rank()
        trace = record(conf, on_position=bar.update, on_start=on_start, rank=rank, world_size=world)
        bar.close()
        if trace is not None:
            n_pos, n_nodes = trace.num_positions, len(trace.node_token)
            print(
                f"trace {trace.path}\n  {trace.num_requests} requests, {n_pos} positions, "
                f"{n_nodes / max(n_pos, 1):.1f} union nodes per position, digest {trace.digest}"
            )

    run()


def _dist_rank() -> tuple[int, int]:
    """(rank, world size) under torchrun (RANK / WORLD_SIZE; a gloo group for the merge barrier), else (0, 1)."""
    import os

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    return rank, world


if __name__ == "__main__":
    main()
