"""The report of `python -m engine.zoo.fine`: the fine-grained target next to the first one, measured in one run.

For each target (the shipped `tiny-moe-fine` and `compare_with`, normally `tiny-moe`), on what ships (bf16 weights,
fp32 forward, one thread):

- held-out nats/token per corpus (`train_lm.evaluate`; the same windows: same split, same tokenizer);
- T(n)/T(1), n = `curve_tokens`: `engine.cost.verify_curve.uncached_forward_curve`, the method of tiny-moe's line
  in zoo/README.md (plain forward, no KV prefix, best of 20);
- distinct experts per MoE layer touched by n consecutive held-out tokens (`distinct_by_prefix`, the count of
  `engine.runtime.footprint.round_footprint`'s U_l), against independent uniform routing E (1 - (1 - r/E)^n);
- per built-in workload (engine.workloads), the realism figures of `engine.zoo.realism` on the greedy path;
- for the fine target's MTP module: held-out t+2 top-1 accuracy and agreement with the target's t+2 argmax
  (teacher-forced), and per workload greedy speculation with `drafter="mtp"`, a chain of depth K: accepted draft
  tokens per round, τ = committed per round (accepted + 1), and whether the output equals target-only greedy.

Shape letters: W=windows T=window length L=MoE layers r=top-r D=hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from engine.cost.synthetic_router import distinct_by_prefix
from engine.cost.utility import expected_distinct_experts
from engine.cost.verify_curve import uncached_forward_curve
from engine.models.mtp import CheckpointMTP, load_checkpoint_mtp
from engine.models.transformer import Model
from engine.runtime.engine import Engine
from engine.spec.config import SpecConfig
from engine.workloads import encode, workload
from engine.zoo.configs import FineEvalConf
from engine.zoo.head_objectives import TargetPass, target_pass
from engine.zoo.realism import greedy_path_figures
from engine.zoo.train_lm import evaluate

EOS = 0  # <|endoftext|> of the zoo tokenizer: greedy paths stop there, as env.record does


def param_counts(model: Model) -> dict[str, int]:
    """Parameters in total and per token (every routed expert but the top-r of each MoE layer left out)."""
    total = sum(p.numel() for p in model.parameters())
    idle = sum((b.num_experts - b.top_r) * (b.experts.gate_up_proj[0].numel() + b.experts.down_proj[0].numel())
               for b in model.moe_blocks)  # fmt: skip
    return {"params": total, "active_params": total - idle}


def distinct_experts(target: Model, windows: torch.Tensor, sizes: list[int]) -> dict[str, float]:
    """Mean distinct experts per MoE layer touched by n consecutive tokens of windows [W, T+1], n in sizes:
    chains of max(sizes) tokens cut from every window, routed in their window's context."""
    ids = target_pass(target, windows).expert_ids.long()  # [W, T, L, r]
    n_max, T = max(sizes), ids.shape[1]
    starts = range(0, T - n_max + 1, n_max)
    chains = [list(ids[w, s : s + n_max].unbind(1)) for w in range(ids.shape[0]) for s in starts]  # L x [n, r] each
    curve = distinct_by_prefix(chains, target.config.num_experts)  # [n_max]
    return {f"n={n}": curve[n - 1] for n in sizes}


@torch.no_grad()
def mtp_heldout(mtp: CheckpointMTP, target: Model, windows: torch.Tensor, data: TargetPass) -> dict[str, float]:
    """Teacher-forced t+2 top-1 accuracy (== x_{t+2}) and agreement with the target's argmax for x_{t+2} (given the
    true x_{t+1}), over every position t = 0..T-2 of windows [W, T+1]."""
    T = windows.shape[1] - 1
    hits = agree = n = 0
    for lo in range(0, windows.shape[0], 16):
        sl = slice(lo, lo + 16)
        f = data.features[sl]  # [B, T, D]
        draft = mtp.logits(mtp(f[:, :-1], mtp.embed_tokens(windows[sl, 1:T]))).argmax(-1)  # [B, T-1] for x_{t+2}
        hits += int((draft == windows[sl, 2:]).sum())
        agree += int((draft == target.lm_head(f[:, 1:]).argmax(-1)).sum())
        n += draft.numel()
    return {"mtp_top1_accuracy_t2": hits / max(n, 1), "mtp_top1_agreement_t2": agree / max(n, 1), "positions": n}


def mtp_acceptance(target: Model, prompts: list[list[int]], new_tokens: int, depth: int) -> dict[str, Any]:
    """Greedy speculation with the target's own MTP module, a chain of `depth` (see the module docstring)."""
    base = [r.token_ids for r in Engine(target, timing=False).generate(prompts, new_tokens, eos_token_id=EOS)]
    res = Engine(target, drafter="mtp", timing=False).generate(prompts, new_tokens, spec=SpecConfig(depth=depth),
                                                               eos_token_id=EOS)  # fmt: skip
    rounds = [r for x in res for r in x.rounds]
    n = max(len(rounds), 1)
    return {
        "depth": depth,
        "rounds": len(rounds),
        "accepted_per_round": sum(r.accepted for r in rounds) / n,
        "tau": sum(r.committed for r in rounds) / n,
        "acceptance_by_depth": [
            sum(r.accepted_by_depth[d] for r in rounds if len(r.accepted_by_depth) > d)
            / max(sum(r.attempted_by_depth[d] for r in rounds if len(r.attempted_by_depth) > d), 1)
            for d in range(depth)
        ],
        "exact": [r.token_ids for r in res] == base,
    }


def report(
    fine: Model,
    compare: Model | None,
    heldout: dict[str, torch.Tensor],
    c: FineEvalConf,
    curve_tokens: list[int],
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Every figure of the module docstring, for `fine` (loaded from its folder, MTP inside) and `compare`."""
    targets = {"fine": fine} | ({"compare": compare} if compare is not None else {})
    windows = torch.cat(list(heldout.values()))  # [W, T+1]
    out: dict[str, Any] = {"names": {k: _name(m) for k, m in targets.items()}}
    out["heldout"] = {k: evaluate(m, None, heldout) for k, m in targets.items()}
    out["verify_cost_curve"] = {k: uncached_forward_curve(m, curve_tokens) for k, m in targets.items()}
    out["distinct_experts"] = {k: distinct_experts(m, windows, list(c.distinct_tokens)) for k, m in targets.items()}
    out["distinct_uniform"] = {
        k: {f"n={n}": expected_distinct_experts(m.config.num_experts, m.config.top_r, n) for n in c.distinct_tokens}
        for k, m in targets.items()
    }
    out["routing"] = {k: {"num_experts": m.config.num_experts, "top_r": m.config.top_r,
                          "moe_layers": len(m.moe_blocks), **param_counts(m)} for k, m in targets.items()}  # fmt: skip
    log("held-out, T(n)/T(1) and distinct experts done")
    mtp = load_checkpoint_mtp(fine)
    out["mtp_heldout"] = mtp_heldout(mtp, fine, windows, target_pass(fine, windows))
    out["mtp_acceptance"], out["realism"] = {}, {k: {} for k in targets}
    for name in c.workloads:
        prompts = encode(fine.tokenizer, workload(name, c.prompts), c.max_prompt_tokens)
        out["mtp_acceptance"][name] = mtp_acceptance(fine, prompts, c.new_tokens, c.mtp_depth)
        for k, m in targets.items():
            out["realism"][k][name] = asdict(greedy_path_figures(m, prompts, c.new_tokens, EOS))
        log(f"workload {name}: MTP {out['mtp_acceptance'][name]}")
    return out


def _name(model: Model) -> str:
    return model.path.rstrip("/").rsplit("/", 1)[-1] if model.path else "target"


# ---------------------------------------------------------------------------------------------- README
def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(x) for x in cells) + " |"


def render_section(r: Any) -> str:
    """The README section of a `engine.zoo.fine.FineResult` (markdown)."""
    rep, t, h = r.report, r.target, r.target["hf_config"]
    keys = [k for k in ("compare", "fine") if k in rep["names"]]
    names = [rep["names"][k] for k in keys]
    routing = rep["routing"]
    acc, ev = rep["mtp_acceptance"], r.config["eval"]
    lines = [
        f"## `{r.name}/`: fine-grained `deepseek_v3` target with its own MTP module",
        "",
        f"Rebuild with `python -m engine.zoo.fine` (seed {r.seed}, {r.config['threads']} thread, bf16 autocast "
        f"{r.autocast_bf16}, shared data used: {r.shared_data_used}; wall time {r.seconds['total'] / 60:.1f} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in r.seconds.items() if k != "total")
        + ").",
        "",
        f"- MLA ({h['num_attention_heads']} heads, kv_lora_rank {h['kv_lora_rank']}, q_lora_rank "
        f"{h['q_lora_rank'] or 'none'}, nope / rope / v head dims {h['qk_nope_head_dim']} / {h['qk_rope_head_dim']} / "
        f"{h['v_head_dim']}), hidden {h['hidden_size']}, {h['num_hidden_layers']} layers (the first "
        f"{h['first_k_dense_replace']} dense, SwiGLU {h['intermediate_size']}), {h['n_routed_experts']} routed "
        f"experts top-{h['num_experts_per_tok']} (dim {h['moe_intermediate_size']}) + {h['n_shared_experts']} shared, "
        f"sigmoid router with correction bias, {h['n_group']} groups top-{h['topk_group']}, scaling "
        f"{h['routed_scaling_factor']}; tiny-moe's tokenizer (vocab {h['vocab_size']}), tied embeddings",
        f"- {t['params'] / 1e6:.2f} M params, {t['active_params'] / 1e6:.2f} M per token "
        + (
            f"({names[0]}: {routing['compare']['params'] / 1e6:.2f} M, {routing['compare']['active_params'] / 1e6:.2f}"
            " M); "
            if "compare" in keys
            else "; "
        )
        + f"MTP module (layer {h['num_hidden_layers']}, MLA + MoE) {r.mtp['params'] / 1e6:.2f} M params; folder "
        f"{r.checkpoint_bytes / 1e6:.1f} MB (bf16)",
        f"- training: {t['steps']} steps x {r.config['target']['train']['batch_size']} x {r.config['seq_len']} "
        f"tokens, final training CE {t['final_ce']:.3f}, router max/mean load {t['final_imbalance']:.2f} "
        f"(correction-bias balancing); MTP {r.mtp['steps']} steps on the frozen target",
        "",
        "Held-out nats/token (fp32 forward of the shipped bf16 weights; same windows for both):",
        "",
        _row(["corpus", "tokens", *names]),
        _row(["---", "--:", *["--:"] * len(keys)]),
    ]
    for corpus, m in rep["heldout"]["fine"].items():
        lines.append(_row([corpus, m["tokens"], *[f"{rep['heldout'][k][corpus]['target_nats_per_token']:.3f}"
                                                  for k in keys]]))  # fmt: skip
    curve = rep["verify_cost_curve"]["fine"]
    sizes = [k for k in curve if not k.startswith("ms_")]
    lines += ["", "T(n)/T(1) (plain forward over n tokens, 1 thread, no KV prefix; both measured in this run):", "",
              _row(["target", "T(1)", *sizes]), _row(["---", *["--:"] * (len(sizes) + 1)])]  # fmt: skip
    for k, n in zip(keys, names):
        c = rep["verify_cost_curve"][k]
        lines.append(_row([n, f"{c['ms_n=1']:.2f} ms", *[f"{c[s]:.2f}" for s in sizes]]))
    counts = list(rep["distinct_experts"]["fine"])
    lines += ["", "Distinct experts per MoE layer touched by n consecutive held-out tokens (in brackets: n tokens "
              "routed independently and uniformly, E (1 - (1 - r/E)^n)):", "",
              _row(["target", "experts", *counts]), _row(["---", "--:", *["--:"] * len(counts)])]  # fmt: skip
    for k, n in zip(keys, names):
        d, u, rt = rep["distinct_experts"][k], rep["distinct_uniform"][k], routing[k]
        lines.append(_row([n, f"{rt['num_experts']} top-{rt['top_r']}", *[f"{d[s]:.1f} ({u[s]:.1f})" for s in d]]))
    mh = rep["mtp_heldout"]
    lines += ["", f"MTP module, held-out (teacher-forced): t+2 top-1 accuracy {mh['mtp_top1_accuracy_t2']:.3f}, "
              f"agreement with the target's t+2 argmax {mh['mtp_top1_agreement_t2']:.3f}. Greedy speculation with "
              f"`drafter=\"mtp\"`, chain K={ev['mtp_depth']}, {ev['prompts']} prompts x {ev['new_tokens']} tokens "
              "per workload:",
              "", _row(["workload", "accepted / round", "τ", "acceptance by depth", "exact"]),
              _row(["---", "--:", "--:", "---", "---"])]  # fmt: skip
    for w, a in acc.items():
        by_depth = " ".join(f"{x:.2f}" for x in a["acceptance_by_depth"])
        lines.append(_row([w, f"{a['accepted_per_round']:.2f}", f"{a['tau']:.2f}", by_depth, a["exact"]]))
    lines += ["", "On each target's own greedy path (`engine.zoo.realism`; stops at <|endoftext|>): mean probability "
              "of the top token, mean entropy, share of generated 4-grams repeating an earlier one:", "",
              _row(["workload", *[f"{n} top p / entropy / repeat4" for n in names]]),
              _row(["---", *["---"] * len(keys)])]  # fmt: skip
    for w in rep["realism"]["fine"]:
        cells = []
        for k in keys:
            f = rep["realism"][k][w]
            cells.append(f"{f['top_prob']:.2f} / {f['entropy']:.2f} / {100 * f['repeat4']:.0f} %")
        lines.append(_row([w, *cells]))
    return "\n".join(lines)
