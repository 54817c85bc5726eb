"""ctrl.hold_select and ctrl.pipeline._select_hold: the hold the trained policies deploy with, chosen on the
training prompts (the held-out prompts decide nothing), written into every seed's card atomically; bad options are
clear errors before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctrl import pipeline
from ctrl.config import MainConf
from ctrl.hold_select import candidates, set_card_hold
from engine.runtime.hold import Hold


def test_candidates_are_the_trained_hold_then_every_length_and_trigger():
    assert candidates(Hold(), [1, 4]) == [Hold(), Hold(1, "plain"), Hold(1, "declined"), Hold(4, "plain"),
                                          Hold(4, "declined")]  # fmt: skip
    assert candidates(Hold(4, "declined"), [4]) == [Hold(4, "declined"), Hold(4, "plain")]  # no repeat
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="hold lengths must be integers >= 1"):
            candidates(Hold(), [bad])


def _cards(tmp_path: Path, n: int = 3) -> list[Path]:
    paths = []
    for s in range(n):
        p = tmp_path / "aggrevate" / f"seed{s}"
        p.mkdir(parents=True)
        (p / "policy.json").write_text(json.dumps({"seed": s, "hold": None}))
        paths.append(p)
    return paths


def test_select_hold_keeps_the_best_on_the_training_prompts(tmp_path, monkeypatch):
    """Each candidate is replayed on the training prompts (`_train_fit` with that hold, the policies loaded once); the
    best goes into every card, the fits into hold_selection.json; a tie keeps the trained hold; an empty
    `hold_select` leaves the cards."""
    paths = _cards(tmp_path)
    fits = {Hold(): 1.00, Hold(1, "plain"): 1.01, Hold(1, "declined"): 1.04, Hold(2, "plain"): 1.03,
            Hold(2, "declined"): 0.9}  # fmt: skip
    asked = []

    def fit(conf, traces, cost, grid, cal, acc, frozen, probe, hold):
        asked.append(hold)
        assert frozen == [f"frozen {p}" for p in paths] and probe is True  # loaded once, for every candidate
        return fits[hold]

    loads = []
    monkeypatch.setattr(pipeline, "_frozen", lambda ps: loads.append(list(ps)) or [f"frozen {p}" for p in ps])
    monkeypatch.setattr(pipeline, "_train_fit", fit)
    conf = MainConf()
    conf.algo.hold_select = [1, 2]
    assert pipeline._select_hold(conf, {}, None, None, None, None, paths, True) == paths
    assert asked == list(fits) and loads == [paths]
    for p in paths:
        assert json.loads((p / "policy.json").read_text())["hold"] == {"rounds": 1, "after": "declined"}
        assert not (p / "policy.json.tmp").exists()
    record = json.loads((tmp_path / "aggrevate" / "hold_selection.json").read_text())
    assert record["selected"] == {"rounds": 1, "after": "declined"} and record["trained"]["rounds"] == 0
    assert len(record["train_committed_per_cost"]) == 5
    fits.update({h: 1.0 for h in fits})  # all tied: the trained hold (none)
    pipeline._select_hold(conf, {}, None, None, None, None, paths, True)
    assert all(json.loads((p / "policy.json").read_text())["hold"] is None for p in paths)
    conf.algo.hold_select = []
    set_card_hold(paths[0], Hold(3))
    pipeline._select_hold(conf, {}, None, None, None, None, paths, True)  # nothing to choose: cards as they are
    assert json.loads((paths[0] / "policy.json").read_text())["hold"] == {"rounds": 3, "after": "plain"}


@pytest.mark.parametrize("field,value,match", [("hold_rounds", -1, "algo.hold_rounds / algo.hold_after"),
                                               ("hold_after", "often", "algo.hold_rounds / algo.hold_after"),
                                               ("hold_select", [0], "hold lengths must be integers >= 1")])  # fmt: skip
def test_bad_hold_options_fail_before_any_work(field, value, match):
    conf = MainConf()
    setattr(conf.algo, field, value)
    with pytest.raises(ValueError, match=match):
        pipeline.check_conf(conf)
