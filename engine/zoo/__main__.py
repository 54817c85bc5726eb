"""`python -m engine.zoo`: train the shipped tiny models (see engine/zoo/build.py for the stages).

    python -m engine.zoo                                  # the default run (~20 min on 2 cores) -> zoo/
    python -m engine.zoo +experiment=zoo_smoke            # < 1 min, tiny sizes, into a temp folder

One progress bar per training stage (`engine.cli.step_bars`; `progress=false` turns them off).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.utils import to_absolute_path
from omegaconf import OmegaConf
from tqdm import tqdm

from engine.cli import quiet_hydra_argv, step_bars
from engine.paths import repo_relative
from engine.zoo.build import run
from engine.zoo.configs import ZooConf
from engine.zoo.train_lm import heldout_table


@hydra.main(config_path="../../conf", config_name="zoo", version_base=None)
def main(cfg) -> None:
    conf: ZooConf = OmegaConf.to_object(cfg)
    out_dir = Path(to_absolute_path(conf.out_dir))
    shared = repo_relative(conf.corpus.shared_data)
    result = run(conf, out_dir, shared, log=tqdm.write, on_step=step_bars() if conf.progress else None)
    print(f"\nheld-out (shipped bf16 weights, fp32 forward) -> {out_dir}\n")
    print(heldout_table(result.heldout))
    curve = ", ".join(f"{k} {v:.2f}" for k, v in result.verify_cost_curve.items() if not k.startswith("ms_"))
    print(f"\ntarget T(n)/T(1): {curve}")
    print(f"checkpoints (bytes): {result.checkpoint_bytes}")
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result.seconds.items())
    print(f"wall time: {result.seconds['total'] / 60:.1f} min ({phases})")


if __name__ == "__main__":
    quiet_hydra_argv()  # no outputs/ folder in the working directory, like the other entry points
    main()
