"""`python -m ctrl.train`: record (or reuse) the traces and train the learned controller, one frozen policy per
seed and cost model (the main job's first half; `python -m ctrl` also evaluates).

    python -m ctrl.train                                  # PPO, 3 seeds, both cost models
    python -m ctrl.train algo.total_timesteps=20000 seeds=[0] wandb.mode=disabled
    python -m ctrl.train +experiment=main_smoke           # a few hundred steps (the smoke test)
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import OmegaConf
from tqdm import tqdm

from ctrl.config import MainConf
from ctrl.pipeline import check_conf, record_traces, train


@hydra.main(config_path="../conf", config_name="main", version_base=None)
def main(cfg) -> None:
    conf: MainConf = OmegaConf.to_object(cfg)
    check_conf(conf)
    out = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir) / conf.out_dir / "policies"
    if conf.wandb.dir is None:
        conf.wandb.dir = str(out.parent)
    traces = record_traces(conf)
    for cost in conf.costs:
        bar = tqdm(total=conf.algo.total_timesteps * len(conf.seeds), desc=f"train PPO ({cost.name})", unit="step")
        paths = train(conf, traces, cost, out, progress=lambda n, bar=bar: bar.update(n))
        bar.close()
        print(f"{cost.name}: " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
