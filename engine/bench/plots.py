"""The PNGs of `python -m engine.bench cost`: measured phases + the fit, and the GPU what-if curves.

    python -m engine.bench cost cost.sizes=[1,2] cost.specs=[olmoe_1b_7b] cost.max_tree=8 out=/tmp/bc.json
    # -> /tmp/bc_measured.png, /tmp/bc_tree_cost.png, /tmp/bc_distinct_experts.png (cost.plot_dir to move them)

`engine.bench_cost.bench_cost` calls these on its result dict when `cost.plot` is true (matplotlib is
imported only then; the caller selects the Agg backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.bench.configs import PHASE_GROUPS, CostBenchConfig
from engine.cost.utility import expected_committed


def plot_measured(res: dict, path: Path) -> None:
    """Stacked measured phases per n with T(n)/T(1) (measured, fitted), and fitted vs measured seconds."""
    import matplotlib.pyplot as plt

    rows, fit = res["measured"]["sizes"], res["fit"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = [r["tokens"] for r in rows]
    x = np.arange(len(ns))
    bottom = np.zeros(len(ns))
    for g in PHASE_GROUPS:
        vals = np.array([sum(r["phases"].get(p, 0.0) for p in PHASE_GROUPS[g]) * 1e3 for r in rows])
        ax1.bar(x, vals, bottom=bottom, label=g)
        bottom += vals
    ax1.set_xticks(x, [str(n) for n in ns])
    title = "phases of one forward (per-op path, timed by phase)"  # T(n) itself: the forward the engine runs
    ax1.set(xlabel="verified tokens n", ylabel="ms (median)", title=title)
    ax1b = ax1.twinx()
    ax1b.plot(x, [r["ratio"] for r in rows], "k-o", label="measured T(n)/T(1)")
    if rows and rows[0].get("fitted_ratio") is not None:
        ax1b.plot(x, [r["fitted_ratio"] for r in rows], "k--", label="fitted model")
    ax1b.legend(loc="lower right", fontsize=8)
    ax1b.set_ylabel("T(n)/T(1)")
    ax1.legend(loc="upper left", fontsize=8)
    pts = fit["points"]
    for held, colour, label in ((False, "tab:blue", "fit samples"), (True, "tab:red", "held out")):
        sel = [p for p in pts if p["heldout"] == held]
        ax2.scatter([p["measured"] * 1e3 for p in sel], [p["fitted"] * 1e3 for p in sel], s=10, c=colour, label=label)
    lim = [0, max(p["measured"] for p in pts) * 1.05e3]
    ax2.plot(lim, lim, "k:", lw=1)
    r2 = fit["r2_heldout"] if fit["r2_heldout"] is not None else fit["r2_train"]
    ax2.set(xlabel="measured ms", ylabel="fitted ms", title=f"fitted cost model (held-out R² = {r2:.3f})")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_what_if(res: dict, c: CostBenchConfig, ratio_path: Path, distinct_path: Path) -> None:
    """T(n)/T_AR per spec against E[committed] (ratio_path), and distinct experts per layer vs tokens."""
    import matplotlib.pyplot as plt

    specs = res["what_if"]
    cols = min(3, len(specs))
    rows_ = -(-len(specs) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.8 * rows_), squeeze=False)
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    for ax, s in zip(axes.flat, specs):
        ns = s["tokens"]
        k = 0
        for hw, layouts in s["hardware"].items():
            for lay, kinds in layouts.items():
                colour, k = colours[k % len(colours)], k + 1
                name = hw.upper() + ("" if lay == "single" else f" {lay.upper()}")
                ax.plot(ns, kinds["calibrated"]["ratio"], "-", c=colour, label=f"{name} calibrated")
                ax.plot(ns, kinds["uniform"]["ratio"], "--", c=colour, label=f"{name} uniform")
        for a in c.alphas:
            ax.plot(ns, [expected_committed(n, a) for n in ns], ":", c="grey", lw=1)
            ax.annotate(
                f"E[committed], α={a}",
                (ns[-1], expected_committed(ns[-1], a)),
                fontsize=7,
                ha="right",
                va="bottom",
                color="grey",
            )
        ax.set(title=s["spec"], xlabel="verified tokens n (chain)", ylabel="T(n) / T_AR")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(specs) :]:
        ax.axis("off")
    fig.suptitle("verification cost vs tree size (roofline; U > 1 where a curve is below the grey E[committed])")
    fig.tight_layout()
    fig.savefig(ratio_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.5 * rows_), squeeze=False)
    for ax, s in zip(axes.flat, specs):
        ns, d = s["tokens"], s["distinct"]
        ax.plot(ns, d["uniform_formula"], "k--", label="uniform M·[1−(1−r/M)^t]")
        ax.plot(ns, d["uniform"], "k:", lw=1, label="uniform (sampled)")
        ax.plot(ns, d["calibrated"], "-", c="tab:red", label="calibrated synthetic router")
        ax.set(
            title=f"{s['spec']} (M={s['num_experts']}, r={s['top_r']})",
            xlabel="tokens t",
            ylabel="distinct experts per layer",
        )
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(specs) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(distinct_path, dpi=110)
    plt.close(fig)
