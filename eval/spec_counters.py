"""Each serving engine's own count of speculative decoding, turned into τ and per-position acceptance
over a window of requests.

llama.cpp (`llamacpp:` prefix, with --metrics) and vLLM (`vllm:`) keep Prometheus counters on
/metrics: drafts made, tokens drafted, tokens accepted, and accepted per draft position. Over a window,
τ = 1 + Δaccepted / Δdrafts and acceptance at position i = Δaccepted_pos[i] / Δdrafts. SGLang counts
per request instead: its `meta_info` carries `completion_tokens` and `spec_verify_ct` (target
verifications), and its own τ is completion_tokens / spec_verify_ct; it has no per-position counter.

τ pooled over a window (Σ tokens / Σ verifications: what vLLM's and SGLang's logs print) weighs long answers more than
τ averaged per request (the mean of each request's own τ: what SpecForge's benchmark prints); `per_request_tau`
gives the second where the engine counts per request: SGLang's meta_info, llama.cpp's per-response `timings`
(draft_n_accepted of its predicted_n tokens: each verification emits its accepted drafts plus one token).
"""

from __future__ import annotations

import re

from core.run.errors import UserError

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_COUNTERS = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
             "spec_decode_num_accepted_tokens_total": "accepted"}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
PROMETHEUS_PREFIX = {"llamacpp": "llamacpp:", "vllm": "vllm:"}


def prometheus_spec_counters(text: str, prefix: str) -> dict:
    """Running totals from a /metrics page -> {"drafts", "draft_tokens", "accepted", "accepted_per_pos"},
    summed over every other label (vLLM has one series per engine and model)."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or not m.group(1).startswith(prefix):
            continue
        name, value = m.group(1)[len(prefix):], float(m.group(3))
        if name == _PER_POS:
            labels = dict(_LABEL.findall(m.group(2) or ""))
            if "position" not in labels:
                raise UserError(f"/metrics: {m.group(1)} sample without a position label: {line.strip()!r}")
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        elif name in _COUNTERS:
            out[_COUNTERS[name]] += value
    out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def counter_window(before: dict, after: dict) -> dict:
    """τ and per-position acceptance of what happened between two /metrics readings."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        raise UserError("the speculative server made no drafts in this window: is drafting on "
                         "(llama.cpp: --spec-type draft-eagle3; vLLM: --speculative-config)?")
    prev = before["accepted_per_pos"] + [0.0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {"acceptance_length": 1 + (after["accepted"] - before["accepted"]) / drafts,
            "per_position_acceptance": [(a - b) / drafts for a, b in zip(after["accepted_per_pos"], prev, strict=True)],
            "verifications": drafts, "draft_tokens": after["draft_tokens"] - before["draft_tokens"]}


def sglang_window(meta_infos: list[dict]) -> dict:
    """SGLang's τ over requests: Σ completion_tokens / Σ spec_verify_ct (its own definition)."""
    missing = [i for i, m in enumerate(meta_infos) if "spec_verify_ct" not in m]
    if missing:
        raise UserError(f"SGLang meta_info of {len(missing)} request(s) has no spec_verify_ct: is the server "
                         "running with --speculative-algorithm EAGLE3?")
    verify = sum(m["spec_verify_ct"] for m in meta_infos)
    if verify <= 0:
        raise UserError("SGLang reported spec_verify_ct == 0 for every request: no speculative step ran")
    return {"acceptance_length": sum(m["completion_tokens"] for m in meta_infos) / verify,
            "per_position_acceptance": None, "verifications": verify, "draft_tokens": None}


def per_request_tau(rows: list[dict], server_type: str) -> float | None:
    """The mean over requests of each one's own τ, from the engine's per-request counts (None where it gave none):
    SGLang's meta_info, llama.cpp's timings, vLLM's metrics.speculative_decoding (only from a server started with
    --per-request-spec-decode-metrics summary: 1 + accepted drafts per verification, its mean_acceptance_length)."""
    taus = []
    for row in rows:
        if server_type == "sglang":
            meta = row["meta_info"]
            taus.append(meta["completion_tokens"] / meta["spec_verify_ct"] if meta.get("spec_verify_ct") else None)
        elif server_type == "llamacpp":
            t = row.get("timings") or {}
            tokens, accepted = t.get("predicted_n"), t.get("draft_n_accepted")
            taus.append(tokens / (tokens - accepted) if tokens and accepted is not None and tokens > accepted else None)
        else:
            spec = (row.get("metrics") or {}).get("speculative_decoding") or {}
            steps, accepted = spec.get("num_spec_steps"), spec.get("num_accepted_draft_tokens")
            taus.append(1 + accepted / steps if steps and accepted is not None else None)
    taus = [x for x in taus if x is not None]
    return sum(taus) / len(taus) if taus else None
