"""A frozen learned policy deployed in the server (`python -m engine.serve policy=PATH`): 16 simultaneous requests
of mixed lengths through the `openai` client over 127.0.0.1 equal `Engine.generate(..., policy=PATH)` greedy
output token for token, as do the same requests to a target-only server; every KV block is free afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from http_server import serving

import engine
from ctrl.freeze import freeze
from engine.paths import zoo_path
from engine.runtime.action_grid import ActionGrid
from engine.runtime.observation import OBS_DIM
from engine.serve.__main__ import ServeConfig, build
from engine.workloads import code_prompts, encode, prose_prompts

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
GRID = ActionGrid(depths=(0, 1, 2, 3, 4), widths=(1, 2), lams=(0.0,), rules=(("all", 0.0), ("threshold", 0.3)))


class _Spaces(gym.Env):
    """Only the spaces a policy over the engine's observation and the action grid needs (nothing is trained)."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, shape=(OBS_DIM,), dtype=np.float32)
        self.action_space = spaces.MultiDiscrete(GRID.nvec)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(OBS_DIM, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(OBS_DIM, dtype=np.float32), 0.0, True, False, {}


@pytest.fixture(scope="module")
def frozen_policy(tmp_path_factory):
    """An untrained SB3 actor with random action logits (so it picks varied K / W / rules), frozen by ctrl.freeze."""
    from stable_baselines3 import PPO

    model = PPO("MlpPolicy", _Spaces(), n_steps=16, batch_size=16, seed=0, device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.policy.action_net.parameters():
            p.normal_(0.0, 2.0)
    return freeze(model, GRID, tmp_path_factory.mktemp("policy") / "random", name="random")


@pytest.fixture(scope="module")
def zoo():
    target = engine.load_model(zoo_path("tiny-moe"))
    drafter = engine.load_model(zoo_path("tiny-dense"))
    prompts = encode(target.tokenizer, code_prompts(8) + prose_prompts(8), 48)
    prompts = [p[: 8 + 3 * i] for i, p in enumerate(prompts)]  # mixed lengths 8 .. 53
    lengths = [6 + (5 * i) % 19 for i in range(len(prompts))]
    return target, drafter, prompts, lengths


@pytest.mark.parametrize("deployed", ["frozen", "none"])
def test_greedy_over_http_equals_engine_generate(zoo, frozen_policy, deployed):
    target, drafter, prompts, lengths = zoo
    policy = str(frozen_policy) if deployed == "frozen" else "none"
    sched, name = build(ServeConfig(model="tiny-moe", drafter="tiny-dense", policy=policy, max_batch=8,
                                    kv_tokens=4096))  # fmt: skip
    reference = engine.Engine(target, drafter if deployed == "frozen" else None)
    with serving(sched, name) as url, ThreadPoolExecutor(len(prompts)) as pool:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i: int):
            return client.completions.create(model=name, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0]  # fmt: skip

        choices = list(pool.map(ask, range(len(prompts))))
        for p, n, choice in zip(prompts, lengths, choices):
            kw = {"policy": policy} if deployed == "frozen" else {}
            ref = reference.generate([p], n, eos_token_id=sched.eos_token_id, **kw)[0].token_ids
            assert choice.model_extra["token_ids"] == ref
            assert choice.text == target.tokenizer.decode(ref)
        drafts = sched.metrics.drafts._value.get()
        assert drafts > 0 if deployed == "frozen" else drafts == 0  # the frozen policy speculated
        assert sched.wait_idle(20)
    sched.engine.kv.check_quiescent()
