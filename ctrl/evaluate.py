"""`python -m ctrl.evaluate`: every policy × workload on the held-out prompts, results.json + report.md + plots.

    python -m ctrl.evaluate                                   # the cached learned policy (trained if absent)
    python -m ctrl.evaluate policy_path=outputs/.../policies/roofline-h200-qwen3_30b_a3b/seed0
    python -m ctrl.evaluate workloads.prompts=questions.jsonl hydra.run.dir=/tmp/eval
    python -m ctrl.evaluate +experiment=regimes               # + experts offloaded (device cache, PCIe misses)
                                                              #   and EP over one 8-GPU node (env.cost_offload,
                                                              #   env.cost_ep), the roofline-trained policies

The same run as `python -m ctrl` (ctrl/__main__.py); `policy_path` evaluates one given frozen policy instead
of the cached seeds.
"""

from __future__ import annotations

from ctrl.__main__ import main

if __name__ == "__main__":
    main()
