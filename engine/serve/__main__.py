"""`python -m engine.serve`: an OpenAI-compatible server with continuous batching and a deployed policy.

    python -m engine.serve                                   # zoo tiny-moe, target-only, 127.0.0.1:8000
    python -m engine.serve policy=static-4                   # zoo tiny-dense drafter, K=4 every round
    python -m engine.serve policy=outputs/.../policies/ppo   # a frozen learned policy (ctrl.freeze)
    python -m engine.serve drafter=eagle-head predictor=expert-predictor policy=PATH port=8001

    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

policy: "none" (target-only), "static-K" (depth K, width 1 every round) or a frozen policy folder.
drafter / predictor / model: a zoo name or a checkpoint folder; the tokenizer is the model folder's
tokenizer.json. cost_hardware: the conf/hardware profile the per-request utility metric is priced on
(engine.cost.round_cost; "auto": this machine's, "none": no pricing). SIGTERM (or Ctrl-C) stops accepting,
finishes in-flight requests, then exits.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf


@dataclass
class ServeConfig:
    model: str = "tiny-moe"  # zoo name or checkpoint folder
    drafter: str = "tiny-dense"  # zoo name, checkpoint / head folder, "ngram"; unused with policy=none
    predictor: str | None = None  # expert-predictor folder (zoo name) for policies with λ > 0
    policy: str = "none"  # none | static-K | frozen policy folder
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    max_queue: int = 64
    queue_timeout: float = 30.0  # seconds a request may wait for KV capacity before a 503
    kv_tokens: int = 16384  # target KV capacity in tokens (num_blocks = kv_tokens / block_size)
    block_size: int = 16
    served_name: str | None = None  # the model id of /v1/models (default: the model folder's name)
    threads: int = 0  # torch intra-op threads (0 = torch's default)
    drain_timeout: float = 60.0
    cost_hardware: str = "auto"  # roofline profile of the utility metric: auto | none | conf/hardware name


ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


def _folder(name: str) -> Path:
    from engine.paths import zoo_dir

    p = Path(name).expanduser()
    return p if (p / "config.json").is_file() else zoo_dir() / name


def build(cfg: ServeConfig):
    """ServeConfig -> (Scheduler, served model name); loads the checkpoints."""
    import engine
    from engine.runtime.frozen import load_frozen_policy
    from engine.serve.scheduler import Scheduler

    path = _folder(cfg.model)
    target = engine.load_model(path)
    if target.tokenizer is None:
        raise SystemExit(f"{path} has no tokenizer.json: the server needs one to encode prompts")
    spec = policy = None
    if cfg.policy == "none":
        drafter = None
    else:
        if cfg.policy.startswith("static-"):
            spec = engine.SpecConfig(depth=int(cfg.policy.removeprefix("static-")))
        else:
            policy = load_frozen_policy(cfg.policy)
        drafter = _drafter(cfg, target)
    options = {"predictor": str(_folder(cfg.predictor))} if cfg.predictor else {}
    eng = engine.Engine(target, drafter, block_size=cfg.block_size, num_blocks=-(-cfg.kv_tokens // cfg.block_size),
                        **options)  # fmt: skip
    eos = target.tokenizer.token_to_id("<|endoftext|>")
    eos = target.config.eos_token_id if eos is None else eos
    sched = Scheduler(eng, target.tokenizer, spec=spec, policy=policy, max_batch=cfg.max_batch,
                      max_queue=cfg.max_queue, queue_timeout=cfg.queue_timeout, eos_token_id=eos,
                      round_cost=None if cfg.cost_hardware == "none" else cfg.cost_hardware)  # fmt: skip
    return sched, cfg.served_name or path.name


def _drafter(cfg: ServeConfig, target):
    import engine

    if cfg.drafter == "ngram":
        return "ngram"
    folder = _folder(cfg.drafter)
    kind = json.loads((folder / "config.json").read_text()).get("model_type", "")
    return str(folder) if kind.startswith("expertspec_") else engine.load_model(folder)  # head folder: by path


@hydra.main(config_path=None, config_name="serve_schema", version_base=None)
def main(cfg: ServeConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    import torch
    import uvicorn

    from engine.serve.app import make_app

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sched, name = build(cfg)
    app = make_app(sched, name, drain_timeout=cfg.drain_timeout)
    print(f"serving {name} ({cfg.policy}) on http://{cfg.host}:{cfg.port}/v1", flush=True)
    # uvicorn drains on SIGTERM (stops accepting, waits for open requests, runs the app's shutdown, which drains
    # the scheduler) and then re-raises the signal under the handler it found: make that a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning",
                timeout_graceful_shutdown=int(cfg.drain_timeout))  # fmt: skip


if __name__ == "__main__":
    from engine.cli import quiet_hydra_argv

    quiet_hydra_argv()
    main()
