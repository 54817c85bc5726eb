"""`python -m ctrl.train`: record (or reuse) the traces and train the learned controllers (`learners`, or one
`ctrl=` preset: conf/ctrl/), one frozen policy per learner, seed and cost model under `<run dir>/policies/` (the main
job's first half; `python -m ctrl` also evaluates).

    python -m ctrl.train                                  # AggreVaTe and PPO, 3 seeds, both cost models
    python -m ctrl.train ctrl=sac seeds=[0] wandb.mode=disabled
    python -m ctrl.train +experiment=main_smoke           # a few hundred steps (the smoke test)
    python -m ctrl.train -m hydra/launcher=joblib seeds=[0],[1],[2]   # a sweep, one job per seed
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import OmegaConf
from tqdm import tqdm

from ctrl.config import MainConf
from ctrl.pipeline import check_conf, record_traces, train, train_steps


@hydra.main(config_path="../conf", config_name="main", version_base=None)
def main(cfg) -> None:
    conf: MainConf = OmegaConf.to_object(cfg)
    check_conf(conf)
    out = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir) / conf.out_dir / "policies"
    if conf.wandb.dir is None:
        conf.wandb.dir = str(out.parent)
    traces = record_traces(conf)
    for cost in conf.costs:
        for learner in conf.learners:
            bar = tqdm(total=train_steps(conf, traces, learner), desc=f"train {learner} ({cost.name})", unit="step")
            paths = train(conf, traces, cost, out, progress=lambda n, bar=bar: bar.update(n), learner=learner)
            bar.close()
            print(f"{cost.name} · {learner}: " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
