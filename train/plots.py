"""Training curves (loss, per-step accuracy, and τ where measured) as a PNG people can glance at."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(rows: list[dict], out: Path) -> None:
    if not rows:
        return
    seen = [r["samples"] for r in rows]  # not steps: a run resumed on another world size changes their size
    taus = [(r["samples"], r["tau"]) for r in rows if "tau" in r]
    fig, axes = plt.subplots(1, 3 if taus else 2, figsize=(15 if taus else 10, 3.6))
    ax1, ax2 = axes[0], axes[1]
    ax1.plot(seen, [r["loss"] for r in rows], color="black")
    ax1.set(title="TTT loss (sum of 0.8^k-weighted steps)", xlabel="samples trained")
    k = 0
    while f"acc_{k}" in rows[0]:
        ax2.plot(seen, [r[f"acc_{k}"] for r in rows], label=f"step {k}")
        k += 1
    ax2.set(title="top-1 draft accuracy per TTT step", xlabel="samples trained", ylim=(0, 1))
    ax2.legend(fontsize=8)
    if taus:
        axes[2].plot(*zip(*taus, strict=True), marker="o", color="tab:red")
        axes[2].axhline(1, color="grey", lw=0.8, ls="--")
        axes[2].set(title="τ: tokens per verification (eval's engine)", xlabel="samples trained",
                    ylim=(0.9, max(t for _, t in taus) * 1.1))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
