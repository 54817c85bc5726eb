"""Gymnasium environments over the engine: `expertspec/Live-v0` (the real engine) and `expertspec/Replay-v0`
(recorded traces, thousands of steps per second). `import env` registers both; both construct with no
arguments (zoo models; the default trace is recorded on first use and cached outside the repository).

    import gymnasium as gym, env
    e = gym.make("expertspec/Replay-v0")        # env.replay.ReplayEnv
    e = gym.make("expertspec/Live-v0")          # env.live.LiveEnv

Traces: env.trace (format), env.record (`python -m env.record`). Oracle: env.oracle. Costs: env.costs.
"""

from gymnasium.envs.registration import register, registry

REPLAY_ID = "expertspec/Replay-v0"
LIVE_ID = "expertspec/Live-v0"

if REPLAY_ID not in registry:
    register(id=REPLAY_ID, entry_point="env.replay:ReplayEnv")
if LIVE_ID not in registry:
    register(id=LIVE_ID, entry_point="env.live:LiveEnv")

__all__ = ["LIVE_ID", "REPLAY_ID"]
