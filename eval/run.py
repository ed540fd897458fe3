"""Measure speculative decoding with a drafter against the plain target (greedy).

    python -m eval --config configs/smollm2-135m-instruct.yaml                 # our HF engine, batch 1
    python -m eval --engine llamacpp                 # + the drafter served by llama.cpp, concurrency 1 and 4
    python -m eval --engine server --server-type vllm --base URL --spec URL    # any running pair of servers
    python -m eval --prompts mt_bench_questions.jsonl --draft runs/x/drafter --out /tmp/mt

hf: per prompt, baseline decode and speculative decode (a chain of K = eval.draft_steps drafts per
target verification, or an EAGLE-2 tree: eval.draft_tree=[depth,topk,total]), both timed after a
warm-up; greedy outputs compared token for token; eval.temperature > 0 samples (speculative sampling).
llamacpp: the drafter converted by llama.cpp's own converter, a base and a speculative llama-server
started on loopback, the same prompt ids sent to both at each concurrency level (eval/server_eval.py),
and the hf engine run on the same prompts, so both engines' τ stand side by side.
Writes report.json, report.md and PNG plots to <run>/eval (or --out).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.drafters.dflash import DFlashDrafter, dflash_generate, is_dflash_dir
from core.drafters.draft_tree import TreeSpec
from core.drafters.drafter import Eagle3Drafter
from core.engine.cpu_linear import split_cpu_linears
from core.engine.decode import Sampling, generate
from core.engine.speculative import Drafting, speculative_generate
from core.run.config import RunConfig, check_ranges, to_dict
from core.run.errors import UserError
from core.storage import trained_prompts
from core.storage.manifest import check_compat, git_sha, read_manifest, write_manifest
from core.storage.stage_lock import stage_lock
from core.target.chat import eval_prompt_ids
from core.target.model import (
    end_of_turn_ids,
    load_target,
    load_target_embeddings,
    load_tokenizer,
    target_info,
)
from eval.llamacpp_server import served_by_llamacpp
from eval.report import common_prefix, server_summary, summarize, write_report
from eval.server_eval import SERVER_TYPES, compare_servers
from eval.server_passes import one_server_pass

log = logging.getLogger("eval")
ENGINES = ("hf", "llamacpp", "server")


def add_eval_args(p) -> None:
    p.add_argument("--prompts", default=None, help="jsonl/json prompt file (MT-Bench, {prompt}, ShareGPT)")
    p.add_argument("--draft", default=None, help="drafter dir: EAGLE-3 (SGLang or speculators format) or DFlash "
                   "(default <run>/drafter)")
    p.add_argument("--out", default=None, help="report dir (default <run>/eval)")
    p.add_argument("--max-prompts", type=int, default=None, help="overrides eval.max_prompts")
    p.add_argument("--max-new-tokens", type=int, default=None, help="overrides eval.max_new_tokens")
    p.add_argument("--engine", choices=ENGINES, default=None, help="overrides eval.engine")
    p.add_argument("--server-type", choices=SERVER_TYPES, default=None, help="overrides eval.server_type")
    p.add_argument("--base", default=None, help="base server root URL (engine server; overrides eval.base_url)")
    p.add_argument("--spec", default=None, help="speculative server root URL (engine server; eval.spec_url)")
    p.add_argument("--concurrency", default=None, help="comma list, e.g. 1,4,16 (overrides eval.concurrency)")
    p.add_argument("--pass", dest="server_pass", choices=("both", "base", "spec"), default=None,
                   help="engine server: one server at a time (overrides eval.server_pass)")


def cli_overrides(args) -> dict:
    """The eval CLI flags as eval.* config fields (None: keep the config's)."""
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    return {"engine": args.engine, "server_type": args.server_type, "base_url": args.base, "spec_url": args.spec,
            "server_pass": args.server_pass,
            "concurrency": levels, "max_prompts": args.max_prompts, "max_new_tokens": args.max_new_tokens}


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def load_engine(cfg: RunConfig, draft_dir: Path):
    """The target, its tokenizer, the drafter (EAGLE-3 or DFlash) on the target's device and dtype, the stop ids."""
    model, tok = load_target(cfg)
    info, head = target_info(cfg), load_target_embeddings(cfg)
    if is_dflash_dir(draft_dir):
        drafter = DFlashDrafter.from_pretrained(Path(draft_dir), head.embed, head.lm_head, info.model_type,
                                                info.num_layers)
    else:
        drafter = Eagle3Drafter.from_pretrained(Path(draft_dir), head.embed, info.model_type, info.num_layers)
    drafter = drafter.to(model.device, model.dtype).eval()
    return model, tok, split_cpu_linears(drafter), end_of_turn_ids(tok, model.generation_config)


def dflash_steps(drafter: DFlashDrafter, ev) -> int:
    """eval.draft_steps for a DFlash drafter: capped at its block's block_size - 1 masks (llama.cpp caps it so
    too); trees, sampling and p_min are EAGLE-3 chain modes."""
    if ev.draft_tree or ev.temperature or ev.draft_p_min:
        raise UserError("a DFlash drafter drafts one greedy block per verification: eval.draft_tree, "
                        "eval.temperature and eval.draft_p_min do not apply")
    return min(ev.draft_steps, drafter.config.block_size - 1)


def hf_eval(cfg: RunConfig, items: list[tuple[str, list[int]]], draft_dir: Path) -> tuple[dict, list[dict]]:
    """Our engine, batch 1: per prompt the plain target decode vs speculative decode with a chain of K
    drafts or an EAGLE-2 tree (eval.draft_tree), greedy or sampled (eval.temperature) -> (summary, rows)."""
    ev = cfg.eval
    model, tok, drafter, stop = load_engine(cfg, draft_dir)
    k, n, t = ev.draft_steps, ev.max_new_tokens, ev.temperature
    tree = TreeSpec(*ev.draft_tree) if ev.draft_tree else None
    g = torch.Generator(model.device).manual_seed(cfg.seed)

    drafting, sampling = Drafting(k, tree, ev.draft_p_min), Sampling(t, g)
    if isinstance(drafter, DFlashDrafter):
        k = dflash_steps(drafter, ev)

        def spec(ids, budget):
            return dflash_generate(model, drafter, ids, budget, stop, k)
    else:
        def spec(ids, budget):
            return speculative_generate(model, drafter, ids, budget, stop, drafting, sampling)

    # warm-up (allocator, kernels) kept out of the timings
    generate(model, [items[0][1]], 4, stop)
    spec(items[0][1], 4)
    results = []
    for pid, ids in tqdm(items, desc="eval (hf engine)", unit="prompt"):
        base, t_base = _timed(lambda ids=ids: generate(model, [ids], n, stop, sampling)[0])
        out, t_spec = _timed(lambda ids=ids: spec(ids, n))
        results.append({"id": pid, "prompt_tokens": len(ids), "tokens": len(out.tokens),
                        "match": base.tokens == out.tokens if t == 0 else None,
                        "agree": common_prefix(base.tokens, out.tokens) if t == 0 else None,
                        "accept_lengths": out.accept_lengths, "drafted": out.drafted,
                        "text": tok.decode(out.tokens, skip_special_tokens=True),
                        "time_baseline_s": t_base, "time_spec_s": t_spec, "baseline_tokens": len(base.tokens)})
    return {**summarize(results, k, ev.draft_tree, t, ev.draft_p_min), "device": str(model.device)}, results


def main(cfg: RunConfig, prompts: str | None = None, draft: str | None = None, out: str | None = None,
         **overrides) -> dict:
    set_flags = {key: value for key, value in overrides.items() if value is not None}
    cfg = dataclasses.replace(cfg, eval=check_ranges(dataclasses.replace(cfg.eval, **set_flags), "eval"))
    ev = cfg.eval  # the caller's config is left as it was; CLI flags are checked like config values
    if ev.draft_tree and len(ev.draft_tree) != 3:
        raise UserError(f"eval.draft_tree must be [depth, topk, total] (or [] for a chain), got {ev.draft_tree}")
    if ev.draft_tree:
        TreeSpec(*ev.draft_tree)  # its shape checks, before anything loads
    if (ev.draft_tree or ev.temperature) and ev.engine != "hf":
        raise UserError(f"eval.draft_tree / eval.temperature are hf-engine modes; engine {ev.engine!r} compares "
                         "servers greedily with a chain of eval.draft_steps")
    if ev.draft_tree and ev.temperature:
        raise UserError("eval.draft_tree is greedy only: set eval.temperature=0 or eval.draft_tree=[]")
    if ev.server_pass == "both":
        if ev.engine == "server" and not (ev.base_url and ev.spec_url):
            raise UserError("eval.engine=server needs both --base URL and --spec URL (eval.base_url, eval.spec_url), "
                            "or one of them with --pass base / --pass spec (one server at a time)")
    elif ev.engine != "server" or not (ev.base_url if ev.server_pass == "base" else ev.spec_url):
        raise UserError(f"eval.server_pass = {ev.server_pass}: a pass against one running server (engine server): "
                        f"give --{ev.server_pass} URL")
    draft_dir = Path(draft) if draft else cfg.run_path / "drafter"
    out_dir = Path(out) if out else cfg.run_path / "eval"
    with stage_lock(out_dir, "eval"):
        return evaluate(cfg, prompts, draft_dir, out_dir)


def drafter_manifest(cfg: RunConfig, draft_dir: Path) -> dict:
    """Our drafters carry a manifest naming their target: a drafter of another target is refused here,
    before anything loads (other trainers' drafters have none; their config.json is checked on load)."""
    if not (draft_dir / "manifest.json").is_file():
        return {}
    manifest = read_manifest(draft_dir, "train")
    check_compat(manifest, {"target": cfg.target.model}, draft_dir)
    return manifest


def prompts_split(cfg: RunConfig, prompts: str | None) -> str:
    source = prompts or cfg.eval.prompts
    if source != "heldout":
        return f"the file {source}"
    return (f"held-out split of {cfg.data_gen.prompts}: {cfg.data_gen.heldout_percent:g}% of its prompts by a hash of their text up to the first user turn, "
            "never given to data_gen")


def evaluate(cfg: RunConfig, prompts: str | None, draft_dir: Path, out_dir: Path) -> dict:
    ev = cfg.eval
    drafted_by = drafter_manifest(cfg, draft_dir) if ev.engine != "server" else {}
    items = eval_prompt_ids(cfg, load_tokenizer(cfg), prompts)
    k, n = ev.draft_steps, ev.max_new_tokens
    seen = trained_prompts.trained_on(draft_dir, items)
    if seen:
        log.warning("%d of %d eval prompts were in the drafter's training data: its τ on them reads higher than on "
                    "held-out prompts (the report says so first)", len(seen), len(items))
    family = None if ev.engine == "server" else "DFlash" if is_dflash_dir(draft_dir) else "EAGLE-3"
    report = {"engine": ev.engine, "target": cfg.target.model, "drafter": str(draft_dir), "drafter_family": family,
              "drafter_fingerprint": drafted_by.get("fingerprint"), "prompts": prompts or ev.prompts,
              "prompts_split": prompts_split(cfg, prompts), "trained_on_prompts": seen,
              "max_new_tokens": n, "git_sha": git_sha(), "config": to_dict(cfg)}
    results: list[dict] = []
    if ev.engine == "server" and ev.server_pass != "both":
        url = (ev.base_url if ev.server_pass == "base" else ev.spec_url).rstrip("/")
        server = one_server_pass(ev.server_pass, url, items, n, ev.concurrency, ev.server_type, out_dir)
        if server is None:  # the other pass is still to come: nothing to report yet
            return {"engine": "server", "server_pass": ev.server_pass, "passes": str(out_dir / "passes")}
        report.update({**server_summary(server, k), "device": f"{ev.server_type} servers, one at a time",
                       "server": server})
    elif ev.engine == "server":
        server = compare_servers(ev.base_url.rstrip("/"), ev.spec_url.rstrip("/"), items, n, ev.concurrency,
                                 ev.server_type)
        report.update({**server_summary(server, k), "device": f"{ev.server_type} servers", "server": server})
    else:
        hf, results = hf_eval(cfg, items, draft_dir)
        report.update(hf)
        if ev.engine == "llamacpp":
            gguf_dir = out_dir / "llamacpp"
            with served_by_llamacpp(cfg, draft_dir, gguf_dir, max(ev.concurrency)) as (base_url, spec_url):
                server = compare_servers(base_url, spec_url, items, n, ev.concurrency, "llamacpp")
            report.update({"hf_engine": {key: report[key] for key in hf}, **server_summary(server, k, ev.draft_p_min),
                           "device": "llama.cpp b11434 llama-server, CPU", "server": server})
    write_report(out_dir, report, results)
    write_manifest(out_dir, "eval", cfg, {"target": cfg.target.model}, {"prompts": len(items)},
                   {"drafter": str(draft_dir), "prompts": prompts or ev.prompts},
                   {"drafter": drafted_by.get("fingerprint"), "engine": ev.engine})
    log.info("acceptance length %.3f (%s), speedup %.2fx, outputs match baseline: %s; report in %s",
             report["acceptance_length"], f"tree {ev.draft_tree}" if ev.draft_tree else f"K={k}", report["speedup"],
             report["outputs_match_baseline"], out_dir)
    return report
