"""The evaluation report: Markdown tables (exact and approximate methods apart, each table stating its
boundary) and the plots people would rather look at than read (DESIGN.md §5)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("policy", "policy", "{}"),
    ("committed_per_cost", "committed / cost", "{:.4g}"),
    ("speedup_vs_ar", "speed-up vs AR", "{:.3f}×"),
    ("tau", "τ", "{:.2f}"),
    ("mean_distinct_experts", "experts / layer / verify", "{:.2f}"),
    ("committed_per_expert_execution", "tokens / expert read", "{:.3f}"),
    ("p50_tpot", "P50 TPOT", "{:.3g}"),
    ("p95_tpot", "P95 TPOT", "{:.3g}"),
    ("p99_tpot", "P99 TPOT", "{:.3g}"),
    ("frac_requests_slowed", "requests slowed", "{:.1%}"),
)


def table(rows: Sequence[dict[str, Any]], extra: Sequence[tuple[str, str, str]] = ()) -> str:
    cols = list(COLUMNS) + list(extra)
    out = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            cells.append("–" if v is None else (fmt.format(v) if not isinstance(v, str) else v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def markdown_report(
    rows: Sequence[dict[str, Any]], boundary: dict[str, str], extra_sections: Sequence[str] = ()
) -> str:
    """rows: results.json rows; boundary: cost_model -> the sentence that states what that table counts."""
    lines = ["# expertspec controller evaluation", ""]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["exact"], r["backend"], r["cost_model"], r["workload"])].append(r)
    for exact in (True, False):
        keys = sorted(k for k in groups if k[0] == exact)
        if not keys:
            continue
        lines += [f"## {'Exact' if exact else 'Approximate'} methods", ""]
        if not exact:
            lines += ["Approximate: these change the target's computation; quality loss is reported beside them.", ""]
        for key in keys:
            _, backend, cost_model, workload = key
            lines += [f"### {workload} · {backend} · {cost_model}", "", boundary.get(cost_model, ""), ""]
            ordered = sorted(groups[key], key=lambda r: -r["committed_per_cost"])
            extra = [("match_rate", "token match vs exact", "{:.3f}"), ("kl", "KL(target logits)", "{:.4f}")]
            lines += [table(ordered, extra if not exact else ()), ""]
    lines += list(extra_sections)
    return "\n".join(lines)


def plot_all(per_policy: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """per_policy[name] = {"acceptance_by_depth": [...], "request_speedups": [...], "actions": [(K, W)...],
    "footprint": [(verified tokens, experts / layer)...]} for one workload and cost model -> PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    color = {name: f"C{i}" for i, name in enumerate(per_policy)}  # one colour per policy in every panel
    for name, d in per_policy.items():
        a = d.get("acceptance_by_depth") or []
        if a:
            ax[0].plot(range(1, len(a) + 1), a, marker="o", label=name, color=color[name], alpha=0.8)
        s = sorted(d.get("request_speedups") or [])
        if s:
            ax[1].step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=name, color=color[name])
        fp = d.get("footprint") or []
        if fp:
            ax[2].scatter([x for x, _ in fp], [y for _, y in fp], s=6, alpha=0.4, label=name, color=color[name])
    ax[0].set(title="acceptance by depth a_d", xlabel="depth d", ylabel="P(accepted | parent accepted)")
    ax[1].axvline(1.0, color="k", lw=0.8, ls="--")
    ax[1].set(title="per-request speed-up vs plain decoding (CDF)", xlabel="speed-up", ylabel="share of requests")
    ax[2].set(title="expert footprint vs verified tokens", xlabel="verified tokens n", ylabel="experts / layer")
    ax[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    p = out_dir / "policies.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    acts = {k: v["actions"] for k, v in per_policy.items() if v.get("actions")}
    if acts:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for i, (name, a) in enumerate(acts.items()):
            ax.step(range(len(a)), [k for k, _ in a], where="post", label=name, color=f"C{i}")
        ax.set(title="chosen depth K over one held-out request", xlabel="round", ylabel="K")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "actions.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


Ratios = dict[str, float]  # workload -> committed per cost ÷ static-best-test's


def plot_headroom(hindsight: dict[str, dict[str, float]], learned: dict[str, Ratios], oracle: Ratios, tokens: int,
                  path: Path) -> Path:  # fmt: skip
    """The oracle's headroom by time scale for one cost model: per workload, committed per cost ÷ static-best-test's
    of the hindsight schedule that changes its action once per request (`tokens`), per S tokens, and every round
    (the oracle), with each learner's ratio as a dashed level. hindsight[wl] = {"request": r, "32": ...};
    learned[learner][wl] = ratio; oracle[wl] = ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (wl, h) in enumerate(hindsight.items()):
        spans = sorted((int(k) for k in h if k != "request"), reverse=True)
        xs = [tokens, *spans, 1]
        ys = [h["request"], *(h[str(s)] for s in spans), oracle[wl]]
        ax.plot(xs, ys, marker="o", color=f"C{i}", label=f"{wl}: hindsight")
        for j, (learner, per_wl) in enumerate(learned.items()):
            if wl in per_wl:
                ax.axhline(per_wl[wl], color=f"C{i}", ls=("--", ":", "-.")[j % 3], lw=0.9, label=f"{wl}: {learner}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="0.5", lw=0.8, ls="--", label="1.10× static-best-test (issue goal)")
    ax.set_xscale("log", base=2)
    ticks = sorted({tokens, 1, *(int(k) for h in hindsight.values() for k in h if k != "request")}, reverse=True)
    ax.set_xticks(ticks, [f"{t} (request)" if t == tokens else "every round" if t == 1 else f"{t}" for t in ticks])
    ax.invert_xaxis()
    ax.set(title="the oracle's headroom by time scale (held-out prompts)", xlabel="tokens between action changes "
           "(left: one per request, right: every round)", ylabel="committed per cost ÷ static-best-test")  # fmt: skip
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
