"""engine.zoo.fine / train_fine: the fine-grained deepseek_v3 zoo target, its balancing and its MTP module.

The smoke run writes into a pytest temp folder only (never into the shipped zoo/); the shipped zoo/tiny-moe-fine
is tested in test_zoo_models.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import engine
from engine.models.checkpoint import build_model, load_model
from engine.models.moe import RoutingRecord
from engine.models.mtp import load_checkpoint_mtp
from engine.zoo.build import _other_entries, merge_zoo_entry
from engine.zoo.configs import FineTargetConf, fine_target_hf_config
from engine.zoo.train_fine import (
    mtp_forward,
    new_checkpoint_mtp,
    padded_expert_compute,
    routed_forward,
    save_with_mtp,
    seq_balance_loss,
    training_experts,
    update_correction_bias,
)
from kernels.fused_moe import fused_moe_ref

REPO = Path(__file__).resolve().parents[2]
TINY = FineTargetConf(hidden_size=32, num_layers=2, num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=8, num_experts=16, top_r=4, n_group=4, topk_group=2,
                      moe_intermediate_size=8, intermediate_size=48, max_position_embeddings=128)  # fmt: skip


@pytest.mark.parametrize(("T", "E", "r"), [(1, 4, 1), (7, 5, 2), (33, 16, 6), (64, 9, 3)])
def test_padded_expert_compute_equals_the_reference(T, E, r):
    """Forward and every gradient equal kernels.fused_moe_ref, with idle experts and -1 (non-local) slots."""
    gen = torch.Generator().manual_seed(T * E + r)
    D, F = 12, 6
    x, w = torch.randn(T, D, generator=gen, dtype=torch.float64), torch.rand(T, r, generator=gen, dtype=torch.float64)
    gu = torch.randn(E, 2 * F, D, generator=gen, dtype=torch.float64)
    down = torch.randn(E, D, F, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, max(1, E - 2), (T, r), generator=gen)  # the last experts get no token
    if T * r > 1:
        ids[0, 0] = -1
    outs, grads = [], []
    for fn in (fused_moe_ref, padded_expert_compute):
        args = [t.clone().requires_grad_() for t in (x, gu, down)]
        wt = w.clone().requires_grad_()
        out = fn(*args, ids, wt)
        outs.append(out)
        grads.append(torch.autograd.grad((out * torch.arange(D)).sum(), [*args, wt]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=1e-12)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)
    none = padded_expert_compute(x, gu, down, torch.full((T, r), -1), w)
    assert torch.equal(none, torch.zeros_like(x))


def test_routed_forward_is_the_plain_forward_and_training_experts_restore():
    model = build_model(fine_target_hf_config(TINY, 101), seed=1)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    record, logits = RoutingRecord(), []
    with torch.no_grad(), training_experts(model):
        assert all(b.expert_fn is padded_expert_compute for b in model.moe_blocks)
        got = routed_forward(model, ids, record, logits)
    assert all(b.expert_fn is None for b in model.moe_blocks)
    torch.testing.assert_close(got, model(ids), atol=1e-5, rtol=1e-5)
    assert record.layers == list(model.config.moe_layers) and [t.shape for t in record.expert_ids] == [(18, 4)]
    assert [t.shape for t in logits] == [(18, 16)]


def test_balance_loss_known_answers():
    """L_bal = 1 for balanced routing with equal scores; concentrating every sequence on r experts raises it."""
    B, T, E = 2, 8, 4
    ids = torch.tensor([[0, 1], [2, 3]] * (B * T // 2))  # every expert gets T r / E = 4 assignments per sequence
    assert seq_balance_loss([torch.zeros(B * T, E)], [ids], B).item() == pytest.approx(1.0)
    logits = torch.full((B * T, E), -4.0)
    logits[:, :2] = 4.0
    skewed = seq_balance_loss([logits], [torch.tensor([[0, 1]] * (B * T))], B).item()
    assert skewed > 1.9  # f = (2, 2, 0, 0), P ~ (1/2, 1/2, 0, 0)


def test_correction_bias_moves_towards_the_mean_load():
    model = build_model(fine_target_hf_config(TINY, 101))
    block = model.moe_blocks[0]
    ids = torch.tensor([[0, 1, 2, 3]] * 6 + [[0, 4, 5, 6]] * 2)  # expert 0 overloaded, 7..15 idle
    imbalance = update_correction_bias([block], [ids], 0.01)
    bias = block.gate.e_score_correction_bias
    assert imbalance == pytest.approx(8 / (32 / 16))
    assert bias[0] == pytest.approx(-0.01) and bias[7:].eq(0.01).all()


def test_mtp_module_saved_in_the_target_folder_loads_as_drafter_mtp(tmp_path):
    """save_with_mtp writes the DeepSeek-V3 layout; load_checkpoint_mtp accounts for every tensor; greedy is exact."""
    target = build_model(fine_target_hf_config(TINY, 101), seed=2)
    mtp = new_checkpoint_mtp(target, seed=3)
    with torch.no_grad():
        mtp.block.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        for p in mtp.parameters():
            if p.requires_grad:  # not the embedding / head: the target's own, not shipped
                p.mul_(5)  # sharp enough to disagree with the target somewhere
    feats, emb = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(mtp_forward(mtp, feats, emb), mtp(feats, emb))
    folder = save_with_mtp(target, mtp, tmp_path / "fine", torch.float32)
    names = json.loads((folder / "config.json").read_text())
    assert names["num_nextn_predict_layers"] == 1 and names["num_hidden_layers"] == TINY.num_layers
    loaded = load_model(folder)
    again = load_checkpoint_mtp(loaded)
    for key, t in mtp.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], t, atol=0, rtol=0)
    prompts = [[5, 9, 3, 3, 7], [11, 2]]
    base = [r.token_ids for r in engine.Engine(loaded).generate(prompts, 12)]
    res = engine.Engine(loaded, drafter="mtp", check_kv=True).generate(prompts, 12, spec=engine.SpecConfig(depth=3))
    assert [r.token_ids for r in res] == base
    deeper = build_model(fine_target_hf_config(replace(TINY, num_layers=3), 101))
    with pytest.raises(ValueError, match="its module at layer 2, got 3"):
        save_with_mtp(target, new_checkpoint_mtp(deeper, 0), tmp_path / "bad", torch.float32)


def test_merge_zoo_entry_keeps_the_rest_and_replaces_its_section(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"seed": 0, "target": {"params": 1}}))
    (tmp_path / "README.md").write_text("# zoo\n\nthe first target\n")
    merge_zoo_entry(tmp_path, "fine", {"a": 1}, "## fine\n\nold")
    merge_zoo_entry(tmp_path, "fine", {"a": 2}, "## fine\n\nnew")
    manifest, readme = json.loads((tmp_path / "manifest.json").read_text()), (tmp_path / "README.md").read_text()
    assert manifest == {"seed": 0, "target": {"params": 1}, "fine": {"a": 2}}
    assert readme.startswith("# zoo\n\nthe first target\n") and readme.count("## fine") == 1 and "new" in readme
    kept, section = _other_entries(tmp_path)  # what python -m engine.zoo carries over when it rewrites both
    assert kept == {"fine": {"a": 2}} and section.strip().startswith("<!-- zoo entry fine") and "new" in section


@pytest.fixture(scope="module")
def smoke_fine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zoo_fine_smoke")
    cmd = [sys.executable, "-m", "engine.zoo.fine", "+experiment=zoo_fine_smoke", f"out_dir={out}",
           f"hydra.run.dir={out / 'hydra'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "tiny-moe-fine" in proc.stdout and "wall time" in proc.stdout
    return out


def test_smoke_run_ships_target_with_mtp_and_reports(smoke_fine: Path):
    folder = smoke_fine / "tiny-moe-fine"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert (folder / "tokenizer.json").read_bytes() == (REPO / "zoo" / "tiny-moe" / "tokenizer.json").read_bytes()
    entry = json.loads((smoke_fine / "manifest.json").read_text())["tiny-moe-fine"]
    rep = entry["report"]
    assert entry["target"]["hf_config"]["model_type"] == "deepseek_v3"
    assert set(rep["names"].values()) == {"tiny-moe-fine", "tiny-moe"}
    assert all(a["exact"] for a in rep["mtp_acceptance"].values())
    for key in ("fine", "compare"):
        d = rep["distinct_experts"][key]
        assert d["n=1"] == pytest.approx(rep["routing"][key]["top_r"]) and d["n=1"] <= d["n=2"] <= d["n=4"]
        for f in rep["realism"][key].values():
            assert 0 < f["top_prob"] <= 1 and 0 <= f["repeat4"] <= 1 and f["entropy"] >= 0
    readme = (smoke_fine / "README.md").read_text()
    assert "## `tiny-moe-fine/`" in readme and "T(n)/T(1)" in readme
    target = load_model(folder)
    assert load_checkpoint_mtp(target).layer_index == target.config.num_layers


def test_configs_compose() -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from engine.zoo.configs import FineZooConf

    with initialize_config_module(config_module="conf", version_base=None):
        default = OmegaConf.to_object(compose(config_name="zoo_fine"))
        smoke = OmegaConf.to_object(compose(config_name="zoo_fine", overrides=["+experiment=zoo_fine_smoke"]))
    assert isinstance(default, FineZooConf) and isinstance(smoke, FineZooConf)
    assert default == replace(FineZooConf(), corpus=default.corpus)  # the YAML restates the schema's defaults
    assert (default.target.num_experts, default.target.top_r, default.target.n_shared_experts) == (64, 6, 1)
    assert smoke.out_dir != "zoo" and smoke.target.train.steps < default.target.train.steps
