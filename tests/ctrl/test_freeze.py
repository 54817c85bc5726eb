"""ctrl.freeze's Box head: the fixed layer that turns a SAC / TD3 action into the grid cell the env decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctrl.freeze import box_cells
from engine.runtime.action_grid import ActionGrid
from env.actions import ActionCodec


@pytest.mark.parametrize("nvec", [[9, 3, 1, 6], [2, 1, 1, 1], [5, 4, 3, 7]])
def test_box_cells_argmax_is_the_env_box_cell(nvec):
    """argmax of each block of box_cells(x) == floor((x + 1) / 2 · n) clipped (env.actions.ActionCodec), for every
    x in [-1, 1] off the cell boundaries (on a boundary the layer takes the lower cell, the codec the upper)."""
    layer = box_cells(nvec).double()
    rules = [("threshold", 0.1 * i) for i in range(nvec[3])]
    grid = ActionGrid(depths=list(range(nvec[0])), widths=list(range(1, nvec[1] + 1)),
                      lams=[0.1 * i for i in range(nvec[2])], rules=rules)  # fmt: skip
    codec = ActionCodec(grid, "box")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-1, 1, (4000, 4)), np.array([[-1.0] * 4, [1.0] * 4])])
    with torch.no_grad():
        logits = layer(torch.from_numpy(x)).numpy()
    ends = np.cumsum(nvec)
    bounds = [-1 + 2 * np.arange(1, n) / n for n in nvec]
    checked = 0
    for row, lg in zip(x, logits):
        if any(len(b) and np.min(np.abs(b - v)) < 1e-9 for b, v in zip(bounds, row)):
            continue
        got = tuple(int(lg[e - n : e].argmax()) for n, e in zip(nvec, ends))
        assert got == codec.decode(row), row
        checked += 1
    assert checked > 3900
