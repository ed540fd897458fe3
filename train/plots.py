"""Training curves (loss and per-step accuracy) as a PNG people can glance at."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(rows: list[dict], out: Path) -> None:
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, [r["loss"] for r in rows], color="black")
    ax1.set(title="TTT loss (sum of 0.8^k-weighted steps)", xlabel="optimizer step")
    k = 0
    while f"acc_{k}" in rows[0]:
        ax2.plot(steps, [r[f"acc_{k}"] for r in rows], label=f"step {k}")
        k += 1
    ax2.set(title="top-1 draft accuracy per TTT step", xlabel="optimizer step", ylim=(0, 1))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
