"""Training curves (loss and per-step accuracy) as a PNG people can glance at."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(rows: list[dict], out: Path) -> None:
    if not rows:
        return
    seen = [r["samples"] for r in rows]  # not steps: a run resumed on another world size changes their size
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(seen, [r["loss"] for r in rows], color="black")
    ax1.set(title="TTT loss (sum of 0.8^k-weighted steps)", xlabel="samples trained")
    k = 0
    while f"acc_{k}" in rows[0]:
        ax2.plot(seen, [r[f"acc_{k}"] for r in rows], label=f"step {k}")
        k += 1
    ax2.set(title="top-1 draft accuracy per TTT step", xlabel="samples trained", ylim=(0, 1))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
