"""Drafters side by side: the reports of `python -m eval --engine llamacpp` runs of several drafters (an EAGLE-3 and
a DFlash one, say) on the same target and prompts, as one table: τ and speedup in our engine, then τ and tokens/s in
llama.cpp at each concurrency level.

    python -m eval compare runs/a/eval runs/b/eval [--out DIR]      # -> DIR/compare.md (default: the first dir)

Reports of another target, other prompts or token budget are refused: their numbers would not compare. A concurrency
level only some reports ran shows "-" in the others' cells.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.run.errors import UserError
from core.storage.atomic_io import atomic_write

SAME = ("target", "prompts", "max_new_tokens", "num_prompts")


def load_reports(dirs: list[Path]) -> list[dict]:
    reports = []
    for d in dirs:
        try:
            reports.append(json.loads((Path(d) / "report.json").read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{d}/report.json: not an eval report ({e})") from None
    for d, r in zip(dirs, reports, strict=True):
        if "hf_engine" not in r:
            raise UserError(f"{d}/report.json: not an --engine llamacpp report (it has no llama.cpp levels beside our "
                            "engine's)")
        if not r.get("drafter_family"):  # the report's own record: the drafter dir may be gone or moved since
            raise UserError(f"{d}/report.json: no drafter_family recorded (an older eval): rerun that eval")
        differ = [k for k in SAME if r.get(k) != reports[0].get(k)]
        if differ:
            raise UserError(f"{d}/report.json: {differ[0]} = {r.get(differ[0])!r}, but {dirs[0]}'s is "
                            f"{reports[0].get(differ[0])!r}: only runs on the same target and prompts compare")
    return reports




def compare_table(reports: list[dict], names: list[str]) -> str:
    levels = sorted({lv["concurrency"] for r in reports for lv in r["server"]["levels"]})  # a level a run skipped: -
    head = ["drafter", "family", "K", "τ ours", "tok/s ours base → spec", "speedup ours"] + [
        f"{what} @{c}" for c in levels for what in ("τ llama.cpp", "tok/s base → spec", "speedup")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in zip(names, reports, strict=True):
        hf, cells, at = r["hf_engine"], [], {lv["concurrency"]: lv for lv in r["server"]["levels"]}
        for lv in (at.get(c) for c in levels):
            cells += ["-"] * 3 if lv is None else [
                f"{lv['acceptance_length']:.3f}", f"{lv['base']['tokens_per_s']:.1f} → {lv['spec']['tokens_per_s']:.1f}",
                f"**{lv['speedup']:.2f}x**"]
        lines.append("| " + " | ".join([name, r["drafter_family"], str(r["draft_steps"]),
                                          f"**{hf['acceptance_length']:.3f}**",
                                          f"{hf['tokens_per_s_baseline']:.1f} → {hf['tokens_per_s_spec']:.1f}",
                                          f"{hf['speedup']:.2f}x", *cells]) + " |")
    r0 = reports[0]
    return "\n".join([f"# Drafters side by side: {r0['target']}", "",
                      f"{r0['num_prompts']} prompts ({r0['prompts']}) x ≤ {r0['max_new_tokens']} new tokens, greedy; "
                      "τ = tokens per target verification; ours = our engine, batch 1; llama.cpp b11434 llama-server "
                      "at each number of requests in flight (τ from its own counters).", "", *lines, ""])


def main(dirs: list[str], out: str | None = None) -> Path:
    if len(dirs) < 2:
        raise UserError("eval compare: give two or more eval report dirs")
    paths = [Path(d) for d in dirs]
    table = compare_table(load_reports(paths), [str(p) for p in paths])
    target = Path(out or paths[0]) / "compare.md"
    atomic_write(target, lambda p: p.write_text(table))
    return target
