"""Training curves (loss, per-step accuracy and acceptance rate alpha, and τ where measured) as a PNG people can
glance at."""

from __future__ import annotations

from pathlib import Path


def plot_curves(rows: list[dict], out: Path) -> None:
    """Imports matplotlib here, at the run's export: the other ranks, a stopped or failed run and every
    `python -m train` start skip its ~0.5 s."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = [r["samples"] for r in rows]  # not steps: a run resumed on another world size changes their size
    taus = [(r["samples"], r["tau"]) for r in rows if "tau" in r]
    third = bool(taus) or "tau_alpha" in rows[0]
    fig, axes = plt.subplots(1, 3 if third else 2, figsize=(15 if third else 10, 3.6))
    ax1, ax2 = axes[0], axes[1]
    ax1.plot(seen, [r["loss"] for r in rows], color="black")
    ax1.set(title="TTT loss (sum of 0.8^k-weighted steps)", xlabel="samples trained")
    k = 0
    while f"acc_{k}" in rows[0]:
        line, = ax2.plot(seen, [r[f"acc_{k}"] for r in rows], label=f"step {k}")
        if f"alpha_{k}" in rows[0]:  # the same step's acceptance rate, dashed in its colour
            ax2.plot(seen, [r[f"alpha_{k}"] for r in rows], color=line.get_color(), ls="--", lw=0.9)
        k += 1
    ax2.set(title="per TTT step: top-1 accuracy (solid), alpha (dashed)", xlabel="samples trained", ylim=(0, 1))
    ax2.legend(fontsize=8)
    if third:
        ax3, top = axes[2], max([t for _, t in taus] + [r.get("tau_alpha", 1) for r in rows])
        if "tau_alpha" in rows[0]:  # over K = train.ttt_steps; the probe decodes at K = eval.draft_steps
            ax3.plot(seen, [r["tau_alpha"] for r in rows], color="grey", label="1 + sum_k prod alpha_j (training)")
        if taus:
            ax3.plot(*zip(*taus, strict=True), marker="o", color="tab:red", label="τ probe (eval's engine)")
        ax3.axhline(1, color="grey", lw=0.8, ls="--")
        ax3.set(title="τ: tokens per verification", xlabel="samples trained", ylim=(0.9, top * 1.1))
        ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
