"""`python -m ctrl`: the main job — record traces, train a controller, evaluate it against every baseline.

    python -m ctrl                                   # built-in workloads, zoo models, ~3-5 min on 2 cores
    python -m ctrl +experiment=main_smoke            # a minute: tiny budgets (the entry point's smoke test)
    python -m ctrl workloads.prompts=questions.jsonl # + a FastChat JSONL workload
    python -m ctrl wandb.mode=disabled seeds=[0]
    python -m ctrl.evaluate +experiment=regimes      # + offloaded experts and EP over 8 GPUs (on request)
    python -m ctrl workers=1                         # one process (default 2: recording shards, cost models)
    python -m ctrl ctrl=sac workload=code            # config groups: learners (conf/ctrl), prompts (conf/workload)

Stages: (1) one trace per workload (train + held-out prompts; cached by content under ~/.cache/expertspec,
so a second run records nothing); (2) per cost model (roofline H200 × Qwen3-30B-A3B, this machine's measured
cost), the learners (`ctrl=`: AggreVaTe and PPO by default) over the training prompts, one frozen policy per
seed (cached by what determines it);
(3) every policy on the held-out prompts: static best (chosen on train / on test), target-only, Cascade, EVICT,
UCB, DISCO, SGLang adaptive, vLLM table / goodput, the learners, the hindsight oracle and the hindsight bounds
per request / per S tokens; (4) results.json, report.md and plots in the run directory (`hydra.run.dir=...`),
the headline table printed. With `workers` > 1 the recording shares the requests among processes
(env.record_pool) and stages (2)–(3) run per cost model side by side (ctrl/stages.py); the figures are those of
`workers=1` (tested), the measured seconds aside.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import hydra
from omegaconf import OmegaConf
from tqdm import tqdm

from ctrl.config import MainConf
from ctrl.pipeline import check_conf, record_traces
from ctrl.report import markdown_report, plot_all, plot_headroom
from ctrl.stages import run_cost_stages
from env.costs import LOOKUP_SPEC, CostConf, drafter_spec_name
from env.models import NGRAM_DRAFTER


def boundary(cost, conf: MainConf) -> str:
    from engine.cost.roofline import load_model_spec
    from env.cost_offload import cache_slots

    m, w = conf.models, conf.workloads
    lookup = str(m.drafter) == NGRAM_DRAFTER
    drafter_name = "prompt lookup (n-gram, model-free)" if lookup else f"zoo/{m.drafter}"
    common = (
        f"Replay of recorded {'greedy' if w.temperature == 0 else f'drafter-invariant sampled (T={w.temperature})'} "
        f"traces: target zoo/{m.target}, drafter {drafter_name}; {w.test} held-out prompts × {w.max_new_tokens} "
        "tokens; exact methods (every policy commits the target's own tokens). Static baselines: the best single "
        f"action of the whole grid chosen on the {w.train} training prompts (static-best-train) or on the "
        "held-out prompts themselves (static-best-test). Unit of committed/cost: tokens per second of cost. "
        + ("Counted: drafting, the probe (the drafter's, or the context probe's prompt lookup, for a policy that "
           "observes it), target verification and the engine's host work per round" if cost.kind == "fitted" else
           "Counted: drafter and target verification, and the probe of a policy that observes it (the context "
           "probe's prompt lookup priced as the lookup's drafting round, 10 µs of host work)")
        + ((", and the learned policies' choice every round (" + ("its timings in place on this machine, a stand-in "
           "of its shape before the live K = 0 rounds" if cost.kind == "fitted" else "10 µs of host work") + "); not "
           "counted: the rules' choices (a few arithmetic operations each) and the oracle's (a bound)."
           ) if conf.algo.price_choice else "; not counted: any controller's choice (measured separately: "
           "`python -m engine.bench mode=policy`).")
    )  # fmt: skip
    transfer = (f" Learned policies: trained under {cost.policies_from}, evaluated here unchanged (a transfer "
                "result)." if cost.policies_from else "")  # fmt: skip
    spec_name = drafter_spec_name(CostConf(drafter_spec=cost.drafter_spec), str(m.drafter), cost.model_spec)
    drafter = ("routing of the priced model from the identity-keyed synthetic router, drafter priced as "
               + (f"host-side prompt lookup ({spec_name}: no device forward)" if spec_name == LOOKUP_SPEC
                  else f"an EAGLE-3-style head ({cost.drafter_spec}), resident"))  # fmt: skip
    if cost.kind == "roofline":
        return (f"Cost: roofline of {cost.hardware.upper()} × {cost.model_spec} (experts resident, one device, no "
                f"EP), {drafter}. " + common + transfer)  # fmt: skip
    if cost.kind == "roofline-offload":
        slots = "" if cost.model_spec == "target" else (
            f" = {cache_slots(cost.offload_cache, load_model_spec(cost.model_spec).num_experts)} slots")  # fmt: skip
        return (f"Cost: roofline of {cost.hardware.upper()} × {cost.model_spec} with the routed experts OFFLOADED to "
                f"host memory: a device cache of {cost.offload_cache:.0%} of each MoE layer's experts{slots} "
                f"({cost.offload_policy.upper()}, empty at each request's start), every verified (layer, expert) "
                "pair not cached loaded over PCIe (bytes / the profile's PCIe bandwidth + its latency per expert, "
                "exposed: no prefetch), one device, no EP; "
                f"{drafter}. T_AR = a plain decode step with the cache plain decoding itself holds at that "
                "position (target-only = exactly 1×). The oracle plans on that plain-decoding cache (a stateful DP "
                "is intractable): a hindsight policy, not an upper bound, under this cost. "
                + common + transfer)  # fmt: skip
    if cost.kind == "roofline-ep":
        return (f"Cost: roofline of {cost.hardware.upper()} × {cost.model_spec} under EXPERT PARALLELISM over "
                f"{cost.ep_ranks} GPUs of one node ({cost.ep_placement} placement; experts resident; one request, "
                "its tokens, attention and LM head on rank 0): per MoE layer the slowest rank's expert time (rank "
                "imbalance) + dispatch and combine all-to-alls over NVLink, from the verified nodes' routing; "
                f"{drafter}; T_AR = the root alone with its own routing. " + common + transfer)  # fmt: skip
    return (
        "Cost: this machine's measured cost (2 CPU cores, one thread), fitted on the trace's timed samples: target "
        "verification (n >= 2) on the recorder's timed forwards; the single-token forward (a K = 0 round's and a "
        "target-only engine's, one fit robust to timing spikes), drafting, the probe and the engine's "
        "host work per round on live rounds timed at batch 1. T_AR = a target-only engine's step. " + common
    )


def run(conf: MainConf, out_dir: Path) -> dict:
    check_conf(conf)
    if conf.wandb.dir is None:  # W&B runs (offline by default) go next to the report, not into the policy cache
        conf.wandb.dir = str(out_dir)
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    w = conf.workloads
    names = list(w.names) + ([w.prompts] if w.prompts else [])
    total = len(names) * (w.train + w.test) * w.max_new_tokens  # positions (fewer when a request hits EOS)
    bar = tqdm(total=total, desc="record traces (positions; cached traces are skipped)", disable=not conf.progress)
    traces = record_traces(conf, on_position=lambda: bar.update(1))
    bar.close()
    t_record = time.perf_counter() - t0
    rows, extras, policies = [], {}, {}
    for cost, (learned, r, p, x) in zip(conf.costs, run_cost_stages(conf, traces)):
        policies[cost.name] = {k: [str(p) for p in v] for k, v in learned.items()}
        rows += r
        extras[cost.name] = x
        for wl, data in p.items():
            plot_all(data, out_dir / "plots" / cost.name / wl)
        headroom_plot(rows, cost.name, x, conf.workloads.max_new_tokens, out_dir / "plots" / cost.name / "headroom.png")
        for src in [p for v in learned.values() for p in v] if not cost.policies_from else ():
            dst = out_dir / "policies" / cost.name / Path(src).parent.name / Path(src).name
            if not dst.exists():  # keep the frozen policies next to the report
                shutil.copytree(src, dst)
    sections = [headroom_bounds(rows, extras), report_extras(extras)]
    md = markdown_report(rows, {c.name: boundary(c, conf) for c in conf.costs}, sections)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=2, default=float))
    (out_dir / "extras.json").write_text(json.dumps(extras, indent=2, default=float))
    (out_dir / "report.md").write_text(md)
    summary = {"rows": rows, "extras": extras, "policies": policies, "seconds": time.perf_counter() - t0,
               "record_seconds": t_record, "out_dir": str(out_dir)}  # fmt: skip
    return summary


def headroom_ratios(rows: list[dict], cost: str, x: dict) -> dict[str, tuple[dict, float, dict[str, float]]]:
    """Per workload of one cost model: (its hindsight bounds, the oracle ÷ static-best-test, {learner: its mean over
    seeds ÷ static-best-test}) from the results rows and that cost model's extras; workloads without both baselines
    are left out."""
    cpc = {(r["workload"], r["policy"]): r["committed_per_cost"] for r in rows
           if r["cost_model"] == cost and r["backend"] == "replay"}  # fmt: skip
    out = {}
    for wl, h in x.get("hindsight", {}).items():
        base, oracle = cpc.get((wl, "static-best-test")), cpc.get((wl, "oracle"))
        if base and oracle is not None:
            learned = {p: cpc[wl, p] / base for p in x.get("headroom", {}) if (wl, p) in cpc}
            out[wl] = (h, oracle / base, learned)
    return out


def headroom_plot(rows: list[dict], cost: str, x: dict, tokens: int, path: Path) -> None:
    """plot_headroom for one cost model (nothing without span bounds: a stateful cost has the request's only)."""
    ratios = {wl: r for wl, r in headroom_ratios(rows, cost, x).items() if len(r[0]) > 1}
    if not ratios:
        return
    learners = dict.fromkeys(p for _, _, learned in ratios.values() for p in learned)
    learned = {p: {wl: r[2][p] for wl, r in ratios.items() if p in r[2]} for p in learners}
    plot_headroom({wl: r[0] for wl, r in ratios.items()}, learned, {wl: r[1] for wl, r in ratios.items()}, tokens,
                  path)  # fmt: skip


def headroom_bounds(rows: list[dict], extras: dict) -> str:
    """Where the oracle's headroom lies: hindsight schedules that may change their action once per request, per
    32 / 16 / 8 / 4 tokens, and every round (the oracle), each ÷ static-best-test, next to the learners."""
    spans = list(dict.fromkeys(k for x in extras.values() for h in x.get("hindsight", {}).values() for k in h))
    spans = [k for k in spans if k != "request"]
    lines = ["## Where the oracle's headroom lies (replay, held-out prompts)", "",
             "Committed per cost ÷ static-best-test's of the best schedule in hindsight that may change its grid "
             "action once per request (the request-level bound: no policy holding one action per request, whatever "
             "it knows about the request, does better), once per S tokens (the first round starting in each span "
             "of S tokens chooses; env.oracle.span_cost), and every round (the oracle). A policy that changes its "
             "action at most once per S tokens wins at most the column of S; more needs per-round information.", "",
             "| cost model | workload | per request | " + " | ".join(f"per {s} tokens" for s in spans)
             + " | every round (oracle) | learned (mean over seeds) |",
             "|---|---|" + "---:|" * (len(spans) + 2) + "---|"]  # fmt: skip
    for cost, x in extras.items():
        for wl, (h, oracle, learned) in headroom_ratios(rows, cost, x).items():
            shown = ", ".join(f"{p} {v:.3f}" for p, v in learned.items())
            cells = " | ".join(f"{h[s]:.3f}" if s in h else "–" for s in spans)
            lines.append(f"| {cost} | {wl} | {h['request']:.3f} | {cells} | {oracle:.3f} | {shown or '–'} |")
    return "\n".join(lines) + "\n"


def report_extras(extras: dict) -> str:
    lines = ["## Learned policy: share of the oracle's headroom and ablation", ""]
    lines += ["Share of headroom = (learned − static-best-test) / (oracle − static-best-test), committed per cost, "
              "per training seed (“no headroom”: the oracle is within 0.1 % of static-best-test).", ""]  # fmt: skip
    lines += ["Fit on the training prompts = the learner's committed per cost on its own training prompts ÷ "
              "static-best-train's there, per seed: below 1 it does not fit what it was trained on (the observation "
              "lacks what it needs); above 1 there but not on the held-out prompts, it over-fits.", ""]  # fmt: skip
    lines += ["| cost model | workload | share per seed | fit on the training prompts | ablation (variant: committed "
              "per cost) |", "|---|---|---|---|---|"]  # fmt: skip
    for cost, x in extras.items():
        for learner, per_wl in x.get("headroom", {}).items():
            for wl, shares in per_wl.items():
                variants = x.get("ablation", {}).get(learner, {}).get(wl, [])
                abl = "; ".join(f"{a['variant']}: {a['committed_per_cost']:.4g}" for a in variants)
                fit = ", ".join(f"{f:.3f}" for f in x.get("train_fit", {}).get(learner, {}).get(wl, [])) or "–"
                share = ", ".join("– (no headroom)" if s != s else f"{s:.1%}" for s in shares)
                lines.append(f"| {cost} | {learner} · {wl} | {share} | {fit} | {abl} |")
    picks = [(c, learner, sel) for c, x in extras.items() for learner, sel in x.get("probe_selection", {}).items()]
    if picks:
        lines += ["", "The drafter has no probe of its own: each learner was trained with and without the context "
                  "probe (the prompt lookup on the host before each choice, engine.runtime.context_probe, paid every "
                  "round) and the variant whose policies commit more per cost on the training prompts (geometric "
                  "mean over workloads and seeds) was kept:", ""]  # fmt: skip
        for cost, learner, sel in picks:
            fits = ", ".join(f"{k} {v:.4g}" for k, v in sel["train_committed_per_cost"].items())
            lines.append(f"- {cost} · {learner}: **{sel['selected']}** (training prompts: {fits})")
    cal = next(iter(extras.values()), {}).get("calibration", {})
    if cal:
        lines += ["", "## Draft-confidence calibration (isotonic per depth, fitted on the training prompts)", ""]
        lines += ["| workload | held-out samples | acceptance | ECE raw | ECE calibrated |", "|---|---|---|---|---|"]
        for wl, c in cal.items():
            lines.append(f"| {wl} | {c['samples']} | {c['accept_rate']:.2f} | {c['ece_raw']:.3f} | "
                         f"{c['ece_calibrated']:.3f} |")  # fmt: skip
    acc = next(iter(extras.values()), {}).get("acceptance", {})
    if acc:
        lines += ["", "## Node acceptance model of the calibrated rule (fitted on the training prompts)", "",
                  "P(node accepted | parent accepted) from the draft probability, the depth and agreement with the "
                  "prompt-lookup continuation (engine.drafting.acceptance); held-out nodes whose parent was accepted.",
                  "", "| workload | samples | Brier raw → model | ECE raw → model | share agree / disagree / none | "
                  "acceptance agree / disagree / none |", "|---|---|---|---|---|---|"]  # fmt: skip
        for wl, c in acc.items():
            lines.append(
                f"| {wl} | {c['samples']} | {c['brier_raw']:.3f} → {c['brier_model']:.3f} | {c['ece_raw']:.3f} → "
                f"{c['ece_model']:.3f} | {c['share_agree']:.2f} / {c['share_disagree']:.2f} / {c['share_none']:.2f} | "
                f"{c['accept_agree']:.2f} / {c['accept_disagree']:.2f} / {c['accept_none']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def headline(rows: list[dict]) -> str:
    """The printed summary, per cost model: every exact policy on replay (static, published, learned with its seeds'
    range, oracle), [share of requests slowed] where > 0, and each learner against static-best-test."""
    out = []
    for cost in dict.fromkeys(r["cost_model"] for r in rows):
        sel = [r for r in rows if r["cost_model"] == cost and r.get("backend", "replay") == "replay" and r["exact"]]
        wls = list(dict.fromkeys(r["workload"] for r in sel))
        by = {(r["policy"], r["workload"]): r for r in sel}
        names = [p for p in dict.fromkeys(r["policy"] for r in sel) if p != "target-only" and "-seed" not in p]
        names = [p for p in names if p != "oracle"] + [p for p in names if p == "oracle"]
        out.append(f"\n== {cost}: speed-up over target-only decoding on held-out prompts (committed per cost ×; "
                   "learned: mean of its seeds, their range; [requests slowed] where > 0) ==")  # fmt: skip
        cells = {}
        for pol in names:
            for wl in wls:
                r = by.get((pol, wl))
                if r is None:
                    cells[pol, wl] = "-"
                    continue
                cell = f"{r['speedup_vs_ar']:.3f}x"
                if r.get("seeds", 1) > 1 and r["committed_per_cost"] > 0:
                    unit = r["speedup_vs_ar"] / r["committed_per_cost"]
                    cell += f" ({r['seed_min'] * unit:.3f}-{r['seed_max'] * unit:.3f})"
                if r["frac_requests_slowed"] > 0:
                    cell += f" [{r['frac_requests_slowed']:.0%}]"
                cells[pol, wl] = cell
        width = max([len(c) for c in cells.values()] + [len(w) for w in wls] + [10]) + 2  # columns never run together
        out.append(f"{'policy':<20}" + "".join(f"{w:>{width}}" for w in wls))
        out += [f"{pol:<20}" + "".join(f"{cells[pol, wl]:>{width}}" for wl in wls) for pol in names]
        for pol in (p for p in names if any("seeds" in by.get((p, w), {}) for w in wls)):  # the learners
            ratios = []
            for wl in wls:
                r, base = by.get((pol, wl)), by.get(("static-best-test", wl))
                ratios.append(f"{r['committed_per_cost'] / base['committed_per_cost']:.3f}" if r and base else "-")
            out.append(f"{pol} ÷ static-best-test: " + " / ".join(ratios) + " (goal ≥ 1.10)")
    return "\n".join(out)


@hydra.main(config_path="../conf", config_name="main", version_base=None)
def main(cfg) -> None:
    conf: MainConf = OmegaConf.to_object(cfg)
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir) / conf.out_dir
    summary = run(conf, out_dir.resolve())
    print(headline(summary["rows"]))
    print(f"\nreport: {out_dir.resolve() / 'report.md'}  (results.json, plots/ next to it); "
          f"{summary['seconds'] / 60:.1f} min (recording {summary['record_seconds'] / 60:.1f} min)")  # fmt: skip


if __name__ == "__main__":
    main()
