"""Hydra schemas of the controller entry points (`python -m ctrl`, `ctrl.train`, `ctrl.evaluate`).

One structured config for the whole job: what is recorded (workloads × models), how requests split into
training and held-out prompts, which cost models price rounds, how the agent is trained, what is
evaluated. YAML under conf/ only sets values (conf/main.yaml, conf/experiment/*.yaml presets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

BUILTIN_WORKLOADS = ["code", "prose", "chat", "math"]


@dataclass
class AlgoConf:
    # ppo | aggrevate (cost-sensitive imitation of an expert, `expert` below; ctrl/aggrevate.py) | aggrevate+ppo |
    # sac | td3 (on the Box variant of the action; ctrl/agent.py)
    name: str = "ppo"
    iterations: int = 6  # AggreVaTe: data-aggregation rounds (expert share β^i)
    # AggreVaTe's cost-to-go: oracle (the hindsight DP, optimistic) | static (the best static action of the
    # training prompts: one policy-improvement step over it)
    expert: str = "static"
    epochs: int = 30  # AggreVaTe: passes over the aggregated states per round
    imitation_lr: float = 3e-3
    imitation_entropy: float = 0.01  # AggreVaTe: α of the −α·H(π) term (tokens of regret; ctrl/aggrevate.py)
    total_timesteps: int = 30_000
    n_envs: int = 4
    n_steps: int = 256
    batch_size: int = 256
    n_epochs: int = 6
    learning_rate: float = 3e-4
    gamma: float = 0.95  # rounds are short horizons: what a round buys shows up within a few rounds
    gae_lambda: float = 0.9
    ent_coef: float = 0.01
    net_arch: list[int] = field(default_factory=lambda: [64, 64])
    # learned policies observe this round's probe before choosing (`confidence_now`, `match_now`; deployed as
    # Session.probe): the drafter's own where it has one (the prompt lookup; a round drafting nothing pays for it),
    # else the context probe, the prompt lookup on the host (engine.runtime.context_probe; every round pays for it)
    probe: bool = True
    # with the context probe (a drafter without a probe of its own): train with and without it and keep, per
    # learner, the variant whose policies commit more per cost on the training prompts (it costs every round, so it
    # can lose where speculation barely pays; ctrl.pipeline.train); False: always observe it
    probe_select: bool = True
    # learned policies pay their choice every round, in training and evaluation alike (the cost model's `choice`:
    # under the measured cost its timings in place, env.host_calibration; under the roofline 10 µs of host work);
    # rules and static actions are not charged theirs
    price_choice: bool = True
    # learned policies hold plain decoding unasked for `hold_rounds` rounds once they choose it (engine.runtime.hold;
    # after "plain": any K = 0, "declined": a K = 0 although the probe proposed a draft), in training, evaluation and
    # the deployed engine alike (their card's `hold`); 0: asked every round
    hold_rounds: int = 0
    hold_after: str = "plain"
    # after training, the hold the policies deploy with is chosen on the training prompts among the trained one and
    # "plain" / "declined" holds of these lengths (ctrl.hold_select); []: deploy the trained hold
    hold_select: list[int] = field(default_factory=lambda: [1, 2, 4, 16])
    normalize_reward: bool = True
    # SAC / TD3 (off-policy, Box action): replay buffer, warm-up steps, Polyak τ, vectorised steps per update,
    # updates per train_freq (-1: one per transition collected, SB3's convention; with 1 and 4 envs SAC saw a
    # quarter of the updates and never found K = 0 under the measured CPU cost), TD3's exploration std (Box units)
    buffer_size: int = 100_000
    learning_starts: int = 1_000
    tau: float = 0.005
    train_freq: int = 1
    gradient_steps: int = -1
    action_noise: float = 0.2
    vec_env: str = "dummy"  # dummy | subproc (one process per env: for costly steps; replay's lookups lose ~3.5x)
    eval_every: int = 10_000  # env steps between held-out evaluations (logged to eval/, selects nothing); 0: off
    checkpoint_every: int = 10_000  # env steps between SB3 checkpoints (<out>/checkpoints/seed<k>/); 0: off


@dataclass
class WandbConf:
    mode: str = "offline"  # online | offline | disabled
    project: str = "expertspec"
    dir: str | None = None  # None: the run's output folder


@dataclass
class WorkloadsConf:
    names: list[str] = field(default_factory=lambda: list(BUILTIN_WORKLOADS))  # engine.workloads built-ins
    prompts: str | None = None  # a FastChat / HumanEval JSONL file: one more workload, named after the file
    train: int = 8  # training prompts per workload (the first ones)
    test: int = 8  # held-out prompts per workload (never seen in training)
    max_new_tokens: int = 64
    max_prompt_tokens: int = 128
    temperature: float = 0.0  # > 0: drafter-invariant seeded sampling (replays exactly)


@dataclass
class ModelsConf:
    target: str = "tiny-moe"
    drafter: str = "eagle-head"
    predictor: str | None = "expert-predictor"
    kmax: int = 8
    widths: list[int] = field(default_factory=lambda: [1, 2, 3])


@dataclass
class CostSpecConf:
    name: str = "roofline-h200-qwen3_30b_a3b"
    # roofline | fitted (this machine's measured cost, fitted on the trace) | roofline-offload (experts in host
    # memory, a device cache, misses over PCIe: env.cost_offload) | roofline-ep (EP over one node: env.cost_ep)
    kind: str = "roofline"
    hardware: str = "h200"
    model_spec: str = "qwen3_30b_a3b"
    drafter_spec: str = "auto"
    offload_cache: float = 0.25  # roofline-offload: device cache slots per MoE layer, a fraction of the experts
    offload_policy: str = "lru"  # roofline-offload: lru | lfu
    ep_ranks: int = 8  # roofline-ep: EP ranks (GPUs of one node)
    ep_placement: str = "contiguous"  # roofline-ep: contiguous | round_robin | load_balanced
    # evaluate the learned policies trained under this other entry of `costs` (a transfer result) instead of
    # training under this cost model; None: train (or reuse the cached policies) under this one
    policies_from: str | None = None


@dataclass
class GridConf:
    depths: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5, 6, 7, 8])
    widths: list[int] = field(default_factory=lambda: [1, 2, 3])
    lams: list[float] = field(default_factory=lambda: [0.0])
    # ("threshold", t): the drafter's raw path probability; ("calibrated", t): the acceptance model fitted on the
    # training prompts (engine.drafting.acceptance: draft probability × depth × n-gram agreement)
    rules: list[list] = field(
        default_factory=lambda: [
            ["all", 0.0], ["threshold", 0.1], ["threshold", 0.3],
            ["calibrated", 0.05], ["calibrated", 0.15], ["calibrated", 0.3],
        ]
    )  # fmt: skip


@dataclass
class WallclockConf:
    """`python -m ctrl.wallclock`: whose policies (an entry of `costs`) run in the live engine, and repeats."""

    cost: str = "measured-cpu"
    repeats: int = 3
    # the steady-state columns count only the tokens from this position on (each round's time pro rata to its
    # committed tokens there): the first rounds after a prefill run slower on a CPU, which replay does not price
    steady_from: int = 16


@dataclass
class MainConf:
    workloads: WorkloadsConf = field(default_factory=WorkloadsConf)
    models: ModelsConf = field(default_factory=ModelsConf)
    costs: list[CostSpecConf] = field(
        default_factory=lambda: [CostSpecConf(), CostSpecConf(name="measured-cpu", kind="fitted")]
    )
    grid: GridConf = field(default_factory=GridConf)
    algo: AlgoConf = field(default_factory=AlgoConf)
    learners: list[str] = field(default_factory=lambda: ["aggrevate", "ppo"])  # learned policies trained and compared
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    wandb: WandbConf = field(default_factory=WandbConf)
    policies: list[str] = field(
        default_factory=lambda: ["cascade", "evict", "ucb", "disco", "sglang-adaptive", "vllm-table", "vllm-goodput"]
    )
    ablation: bool = True
    live_requests: int = 1  # held-out requests per workload also run on the live engine (0: replay only)
    policy_path: str | None = None  # ctrl.evaluate: a frozen policy folder; None: train (or reuse the cached one)
    out_dir: str = "."  # results.json, report.md, plots, policies (relative: the Hydra run dir)
    progress: bool = True
    # processes: recording shares every workload's requests among them (env.record_pool; the measured seconds
    # are then taken with every core busy), and the cost models train and evaluate side by side; 1: one process
    workers: int = 2
    wallclock: WallclockConf = field(default_factory=WallclockConf)  # ctrl.wallclock only


ConfigStore.instance().store(name="main_schema", node=MainConf)
