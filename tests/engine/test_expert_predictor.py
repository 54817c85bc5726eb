"""Expert predictor (top-r sets, recall, tree selection) and the `engine.zoo.train_heads` smoke run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine.drafting.feature_drafter import EagleDrafter, MTPDrafter
from engine.drafting.selection import select_by_probability, select_verified
from engine.models.expert_predictor import (
    ExpertPredictor,
    ExpertPredictorConfig,
    load_expert_predictor,
    routing_loss,
    save_expert_predictor,
    topr_mask,
    topr_recall,
)
from engine.models.feature_heads import load_eagle_head, load_mtp_head
from engine.spec.draft_tree import DraftTree
from engine.zoo.train_heads import HEAD_NAMES, TrainHeadsConf, run, smoke_target

REPO = Path(__file__).resolve().parents[2]


def test_topr_sets_are_well_formed_and_recall_is_calibrated():
    gen = torch.Generator().manual_seed(0)
    N, L, E, r = 4000, 3, 8, 2
    logits = torch.randn(N, L, E, generator=gen)
    mask = topr_mask(logits, r)
    assert mask.dtype == torch.bool and mask.shape == (N, L, E)
    assert bool((mask.sum(-1) == r).all())
    assert bool((mask == (logits >= logits.topk(r, -1).values[..., -1:])).all())
    routed = torch.stack([torch.randperm(E, generator=gen)[:r] for _ in range(N * L)]).view(N, L, r)
    perfect = torch.zeros(N, L, E).scatter_(-1, routed, 5.0)
    assert torch.equal(topr_recall(perfect, routed), torch.ones(L))
    chance = topr_recall(logits, routed)
    assert bool(((chance - r / E).abs() < 0.03).all())  # random guessing scores r / E
    assert routing_loss(perfect, routed) < routing_loss(torch.zeros(N, L, E), routed)


def _tree(pred: torch.Tensor) -> DraftTree:
    #      0
    #    1   2        node 1 likelier, node 2 needs no new expert
    #    3
    return DraftTree(
        tokens=torch.tensor([9, 1, 2, 3]),
        parents=torch.tensor([-1, 0, 0, 1]),
        depths=torch.tensor([0, 1, 1, 2]),
        path_prob=torch.tensor([1.0, 0.5, 0.4, 0.3]),
        predicted_experts=pred,
    )


def test_select_verified_modes():
    pred = torch.zeros(4, 2, 4, dtype=torch.bool)
    pred[:, :, :2] = True  # root needs experts {0, 1} in both layers
    pred[1, :, 1], pred[1, :, 3] = False, True  # node 1 adds expert 3
    pred[3, :, 1], pred[3, :, 2] = False, True  # node 3 adds expert 2
    tree = _tree(pred)
    by_prob = select_verified(tree, engine.SpecConfig(depth=2, width=2, max_verify=1), drafted=False)
    assert by_prob.tokens.tolist() == [9, 1] and torch.equal(select_by_probability(tree, 1), torch.tensor([0, 1]))
    aware = select_verified(tree, engine.SpecConfig(depth=2, width=2, max_verify=1, lam=0.5), drafted=False)
    assert aware.tokens.tolist() == [9, 2]  # the free node beats the likelier but costlier one
    full = select_verified(tree, engine.SpecConfig(depth=2, width=2, lam=0.01), drafted=False)
    assert full.num_nodes == 4
    assert select_verified(tree, engine.SpecConfig(depth=2, width=2, max_verify=1), drafted=True) is tree


def test_predictor_save_load_roundtrip(tmp_path):
    torch.manual_seed(0)
    predictor = ExpertPredictor(ExpertPredictorConfig(16, 8, 6, 2, (0, 2), input="eagle")).eval()
    save_expert_predictor(predictor, tmp_path / "p")
    loaded = load_expert_predictor(tmp_path / "p")
    assert loaded.config == predictor.config
    x = torch.randn(5, 16)
    torch.testing.assert_close(loaded(x), predictor(x), atol=0.05, rtol=0.05)  # bf16 weights
    with pytest.raises(ValueError, match="expertspec_expert_predictor"):
        (tmp_path / "p" / "config.json").write_text(json.dumps({"model_type": "llama"}))
        load_expert_predictor(tmp_path / "p")


def test_config_composes():
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="train_heads", overrides=["smoke=true", "eagle.train.steps=7"])
    conf = OmegaConf.to_object(cfg)
    assert isinstance(conf, TrainHeadsConf) and conf.smoke and conf.eagle.train.steps == 7


@pytest.fixture(scope="module")
def smoke_cli(tmp_path_factory):
    """`python -m engine.zoo.train_heads smoke=true` end to end (the entry point's smoke test)."""
    run_dir = tmp_path_factory.mktemp("hydra")  # Hydra's own files (.hydra/, the log) go there
    command = [sys.executable, "-m", "engine.zoo.train_heads", "smoke=true", "progress=false"]
    command.append(f"hydra.run.dir={run_dir}")
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out_dir = Path(re.search(r"heads -> (\S+)", proc.stdout).group(1))
    metrics = {name: json.loads((out_dir / name / "metrics.json").read_text()) for name in HEAD_NAMES}
    yield metrics, out_dir
    shutil.rmtree(out_dir, ignore_errors=True)


def test_smoke_training_writes_small_folders_and_learns_routing(smoke_cli):
    metrics, out_dir = smoke_cli
    for name in HEAD_NAMES:
        files = {f.name for f in (out_dir / name).iterdir()}
        assert {"config.json", "model.safetensors", "metrics.json"} <= files
        assert sum(f.stat().st_size for f in (out_dir / name).iterdir()) < 2_000_000
    p = metrics["expert-predictor"]
    assert all(x > p["random_baseline"] for x in p["topr_recall_per_layer"])
    for name in ("eagle-head", "mtp-head"):
        assert all(s["exact"] for s in metrics[name]["speculative"].values())
    assert 0.0 <= metrics["eagle-head"]["eagle_top1_agreement"] <= 1.0


def test_smoke_training_is_deterministic(smoke_cli, tmp_path):
    _, out_dir = smoke_cli
    again = run(TrainHeadsConf(smoke=True))  # same seed, in-process
    for name in HEAD_NAMES:
        a = (out_dir / name / "model.safetensors").read_bytes()
        b = (Path(again["out_dir"]) / name / "model.safetensors").read_bytes()
        assert a == b, name
    shutil.rmtree(again["out_dir"], ignore_errors=True)


def test_trained_smoke_heads_as_drafters(smoke_cli):
    _, out_dir = smoke_cli
    target = smoke_target(0)
    prompts = [list(b"def main():\n    "), list(b"The "), [32]]
    base = [r.token_ids for r in engine.Engine(target).generate(prompts, 16)]
    predictor = load_expert_predictor(out_dir / "expert-predictor")
    drafters = [
        EagleDrafter(load_eagle_head(out_dir / "eagle-head", target), target, predictor),
        MTPDrafter(load_mtp_head(out_dir / "mtp-head", target), target),
    ]
    for drafter in drafters:
        eng = engine.Engine(target, drafter=drafter, check_kv=True)
        lam_spec = engine.SpecConfig(depth=3, width=2, lam=1.0)
        for spec in (engine.SpecConfig(depth=3, width=1), lam_spec):
            if spec.lam > 0 and not drafter.predicts_experts:  # λ without a predictor: a clear error, not ignored
                with pytest.raises(ValueError, match="expert predictor"):
                    eng.generate(prompts, 16, spec=spec)
                continue
            assert [r.token_ids for r in eng.generate(prompts, 16, spec=spec)] == base
        drafter.kv.check_quiescent()
