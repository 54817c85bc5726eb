"""Choosing the hold a learned policy deploys with (engine.runtime.hold) on the training prompts.

A hold trades the choice's cost (probe, actor, cooled caches: every round a learned policy is asked) against the
rounds it then cannot speculate in. Which side wins depends on the drafter and the cost model: under this CPU's
measured cost with the EAGLE head every round is best decoded plainly, and asking costs ~3 % a round; with the
prompt lookup under the roofline almost nothing. So the main job tries candidates after training: the policies'
trained hold, and "plain" and "declined" holds of each length of `algo.hold_select`, each replayed on the training
prompts (ctrl.pipeline._train_fit); the best goes into the policies' cards. The held-out prompts decide nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from engine.runtime.hold import AFTER, Hold


def candidates(trained: Hold, rounds: Sequence[int]) -> list[Hold]:
    """The trained hold first (it wins ties), then every (length, trigger) of `rounds` × AFTER, without repeats."""
    out = [trained]
    for n in rounds:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"algo.hold_select: hold lengths must be integers >= 1, got {n!r}")
        out += [h for after in AFTER if (h := Hold(int(n), after)) not in out]
    return out


def set_card_hold(path: str | os.PathLike, hold: Hold) -> None:
    """Write `hold` into the frozen policy's card at `path` (its folder), atomically: a crash leaves the old card."""
    card_path = Path(path) / "policy.json"
    card = json.loads(card_path.read_text())
    card["hold"] = hold.to_dict() if hold else None
    tmp = card_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(card, indent=2))
    os.replace(tmp, card_path)
