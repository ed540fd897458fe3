"""One server at a time: a base pass and a speculative pass over the same prompts, run one after the other and
combined into the report a paired run writes (eval/server_eval.py), for a target two copies of which do not fit
one node (Kimi-K2.5 on one 8-GPU node):

    python -m eval --config C --engine server --pass base --base URL   # the base server up, alone
    python -m eval --config C --engine server --pass spec --spec URL   # then the speculative one: writes the report

Each pass keeps its finished concurrency levels in <out>/passes/<base|spec>.json (atomic), so a killed pass
reruns only the levels it had not finished, and records its server's identity (its /v1/models, which names the
model it serves). Combining refuses passes of other prompts, token budgets, levels or server types, or of two
different target models. A paired run takes turns between the servers over the same minutes; passes are
minutes or hours apart, so their speedup carries whatever else changed on the machine in between.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import httpx

from core.run.errors import UserError
from core.storage.atomic_io import atomic_write_json
from eval.server_eval import (
    level_summary,
    metrics,
    paired_level,
    request,
    run_level,
    spec_window_counts,
)

log = logging.getLogger("eval")
PASSES = ("base", "spec")


def server_identity(url: str) -> dict:
    """What the server says it serves: GET /v1/models (SGLang, vLLM and llama.cpp all answer it)."""
    try:
        r = httpx.get(f"{url}/v1/models", timeout=30)
        r.raise_for_status()
        models = sorted(m["id"] for m in r.json()["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{url}/v1/models: no model list ({e}): is this an OpenAI-compatible server?") from None
    return {"url": url, "models": models}


def prompts_digest(items: list[tuple[str, list[int]]]) -> str:
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def run_pass(kind: str, url: str, items: list[tuple[str, list[int]]], n: int, levels: list[int], server_type: str,
             path: Path) -> dict:
    """The pass `kind` against the one server at `url`: each level in `levels` not already in `path` (a pass of
    the same prompts, budget, server type and served model), saved as it finishes -> the pass record."""
    identity = server_identity(url)
    key = {"pass": kind, "server_type": server_type, "prompts": prompts_digest(items), "num_prompts": len(items),
           "max_new_tokens": n, "models": identity["models"]}
    record = json.loads(path.read_text()) if path.is_file() else {}
    if {k: record.get(k) for k in key} != key:
        record = {**key, "server": identity, "levels": {}}
    todo = [c for c in levels if str(c) not in record["levels"]]
    if todo:
        request(url, items[0][1], 8, server_type)  # warm-up, outside every window
    for c in todo:
        before = metrics(url, server_type) if kind == "spec" else None
        done = run_level(url, items, n, c, server_type)
        level = level_summary(done["rows"], done["wall_s"])
        if kind == "spec":
            level["counted"] = spec_window_counts(url, server_type, before, level["rows"])
        record["levels"][str(c)] = level
        atomic_write_json(path, record)
        log.info("%s pass, concurrency %d: %.1f tok/s, saved to %s", kind, c, level["tokens_per_s"], path)
    return record


def combine(base: dict, spec: dict, levels: list[int]) -> dict:
    """The two pass records -> the server part of the report, in compare_servers' shape."""
    for k in ("server_type", "prompts", "max_new_tokens"):
        if base[k] != spec[k]:
            raise UserError(f"eval passes: the base pass ran with {k} {base[k]!r}, the speculative one with "
                            f"{spec[k]!r}: rerun one of them with the other's settings")
    if base["models"] != spec["models"]:
        raise UserError(f"eval passes: the base server served {base['models']}, the speculative one "
                        f"{spec['models']}: both passes must run the same target")
    missing = [c for c in levels if str(c) not in base["levels"] or str(c) not in spec["levels"]]
    if missing:
        raise UserError(f"eval passes: concurrency {missing} not in both passes; rerun the pass that lacks it")
    out = [paired_level(c, base["levels"][str(c)], spec["levels"][str(c)], spec["levels"][str(c)]["counted"],
                        base["server_type"]) for c in levels]
    return {"server_type": base["server_type"], "base_url": base["server"]["url"], "spec_url": spec["server"]["url"],
            "levels": out, "num_prompts": base["num_prompts"], "max_new_tokens": base["max_new_tokens"],
            "one_server_at_a_time": {kind: {"server": rec["server"]} for kind, rec in (("base", base), ("spec", spec))}}


def one_server_pass(kind: str, url: str, items: list[tuple[str, list[int]]], n: int, levels: list[int],
                    server_type: str, out_dir: Path) -> dict | None:
    """Run pass `kind`; once both passes hold every level -> the combined server report, else None."""
    passes = Path(out_dir) / "passes"
    run_pass(kind, url, items, n, levels, server_type, passes / f"{kind}.json")
    other = next(p for p in PASSES if p != kind)
    if not (passes / f"{other}.json").is_file():
        log.info("%s pass done (%s); start the %s server and run --pass %s to combine them into the report", kind,
                 passes / f"{kind}.json", other, other)
        return None
    records = {p: json.loads((passes / f"{p}.json").read_text()) for p in PASSES}
    return combine(records["base"], records["spec"], levels)
