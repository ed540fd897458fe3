"""Turn per-prompt eval results into report.json, a slide-ready report.md and PNG plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from core.atomic_io import atomic_write_json, atomic_write_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def summarize(results: list[dict], draft_steps: int) -> dict:
    """τ = mean tokens per verification; draft i counts as accepted in a round that added > i+1 tokens."""
    lengths = [a for r in results for a in r["accept_lengths"]]
    steps = max(1, len(lengths))
    tokens = sum(r["tokens"] for r in results)
    t_base = sum(r["time_baseline_s"] for r in results)
    t_spec = sum(r["time_spec_s"] for r in results)
    base_tokens = sum(r["baseline_tokens"] for r in results)
    tps_base, tps_spec = base_tokens / t_base, tokens / t_spec
    return {
        "acceptance_length": sum(lengths) / steps,
        "per_position_acceptance": [sum(a > i + 1 for a in lengths) / steps for i in range(draft_steps)],
        "accept_length_histogram": [sum(a == i for a in lengths) for i in range(1, draft_steps + 2)],
        "outputs_match_baseline": all(r["match"] for r in results),
        "mismatched_prompts": [r["id"] for r in results if not r["match"]],
        "tokens_per_s_baseline": tps_base, "tokens_per_s_spec": tps_spec, "speedup": tps_spec / tps_base,
        "num_prompts": len(results), "verify_steps": len(lengths), "generated_tokens": tokens,
        "draft_steps": draft_steps, "temperature": 0.0,  # greedy: the only mode so far
    }


def _markdown(r: dict) -> str:
    pos = " | ".join(f"{p:.2f}" for p in r["per_position_acceptance"])
    head = " | ".join(f"draft {i + 1}" for i in range(r["draft_steps"]))
    return f"""# EAGLE-3 drafter: speculative decoding report

Target `{r['target']}` on `{r['device']}`, drafter `{r['drafter']}`, prompts `{r['prompts']}`,
greedy (T={r['temperature']}), batch 1, chain of {r['draft_steps']} drafts per verification.

| metric | value |
|---|---|
| acceptance length τ (tokens per target verification, bonus included) | **{r['acceptance_length']:.3f}** |
| speedup vs plain target decode | **{r['speedup']:.2f}x** |
| tokens/s baseline → speculative | {r['tokens_per_s_baseline']:.1f} → {r['tokens_per_s_spec']:.1f} |
| outputs identical to greedy baseline | {r['outputs_match_baseline']} |
| prompts / verifications / tokens | {r['num_prompts']} / {r['verify_steps']} / {r['generated_tokens']} |

Per-position acceptance (fraction of verifications that accepted draft i):

| {head} |
|{'---|' * r['draft_steps']}
| {pos} |

![acceptance](acceptance.png)
"""


def _plot(r: dict, out: Path) -> None:
    k = r["draft_steps"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.bar(range(1, k + 1), r["per_position_acceptance"], color="#3b7dd8")
    ax1.set(title="accepted at draft position", xlabel="draft position", ylabel="fraction of verifications",
            ylim=(0, 1))
    ax2.bar(range(1, k + 2), r["accept_length_histogram"], color="#e0833a")
    ax2.axvline(r["acceptance_length"], color="black", linestyle="--", label=f"τ = {r['acceptance_length']:.2f}")
    ax2.set(title="tokens per verification", xlabel="accepted + bonus", ylabel="count")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_report(out_dir: Path, report: dict, results: list[dict]) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "report.json", {**report, "per_prompt": results})
    atomic_write_text(out_dir / "report.md", _markdown(report))
    _plot(report, out_dir / "acceptance.png")
