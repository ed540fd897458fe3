"""A drafter from the pipeline, served by the real llama-server b11434 (`make llamacpp`), accepts what
our HF engine accepts: the exported format, the aux layers and the decode rule mean the same thing in
an engine someone else wrote.

The drafter is the tiny target's, trained until it memorises the target's 12 greedy answers, and both
engines run on those 12 prompts at K=3, so τ is far above 1 (2.2 here) and a disagreement shows.
Tolerance: only prompts where both targets write the same greedy text count (10 of 12 here: the random
tiny target has near-ties that llama.cpp's f32 kernels and torch break differently, and past such a
token the drafter is off its training data in one engine only). On those, the draft tokens llama.cpp
accepted per prompt (its `timings.draft_n_accepted`) must equal ours on >= 90% of prompts and within 5%
in total; measured: equal on 10 of 10. Reading the aux layers one off must break that (measured: 40
accepted instead of 83). The same data trained with train.norm_before_fc=true (EAGLE-3.1: llama.cpp's
eagle3 encoder applies enc.output_norm before fc) and train.loss=lk_lambda agrees the same way: measured equal
on 10 of 10, 84 accepted drafts in both engines (τ 2.32 ours). A DFlash block drafter trained on the same shards (block 4, 8 anchors a
sample, the target's own LM head, so it needs more steps: 80 epochs at lr 1e-2) agrees as well: measured equal on
10 of 10 prompts, 77 accepted drafts in both engines (τ 2.07 ours; 16 anchors: 81, τ 2.19, 8 CPU-s more)."""

import json
import shutil

import pytest

from core.target.chat import eval_prompt_ids
from core.target.model import cache_root, load_tokenizer, resolve_target
from eval.llamacpp import convert_drafter, gguf_target_layers
from eval.llamacpp_build import llamacpp_tree, server_binary
from eval.llamacpp_server import LlamaServer, SpecDraft
from eval.server_eval import run_level
from tests.conftest import run_stage


@pytest.fixture(scope="module")
def served(overfit_tiny):
    cfg, run_dir, flags, prompts = overfit_tiny
    run_stage("eval", *flags, "--engine", "llamacpp", "--prompts", str(prompts), "--concurrency", "1,2")
    return cfg, run_dir, prompts, json.loads((run_dir / "eval/report.json").read_text())


def same_output_prompts(report: dict) -> dict[str, int]:
    """prompt id -> draft tokens our engine accepted, for prompts whose greedy text both engines share."""
    base = {r["id"]: r["text"] for r in report["server"]["levels"][0]["base"]["rows"]}
    return {p["id"]: sum(a - 1 for a in p["accept_lengths"]) for p in report["per_prompt"] if p["text"] == base[p["id"]]}


def served_ggufs(run_dir) -> tuple:
    """(target, drafter) GGUFs the `served` eval converted, for more servers of the same files."""
    return run_dir / "eval/llamacpp/target-f32.gguf", next((run_dir / "eval/llamacpp").glob("drafter-*.gguf"))


def llamacpp_accepted(rows: list[dict]) -> dict[str, int]:
    return {r["id"]: r["timings"]["draft_n_accepted"] for r in rows}


@pytest.fixture(scope="module")
def served_norm_before_fc(served, overfit_tiny, tmp_path_factory):
    """The overfit run's conversations and shards, trained again with train.norm_before_fc=true (EAGLE-3.1) and
    train.loss=lk_lambda (an LK loss trains, exports and serves as kl does), then converted and served the same way, beside the target GGUF that `served` converted (eval.target_gguf:
    the same target through the same converter)."""
    _, run_dir, flags, prompts = overfit_tiny
    norm_run = tmp_path_factory.mktemp("norm-before-fc") / "run"
    for stage_dir in ("conversations", "hidden"):
        shutil.copytree(run_dir / stage_dir, norm_run / stage_dir)
    norm_flags = [str(norm_run) if f == str(run_dir) else f for f in flags] + [
        "train.norm_before_fc=true", "train.loss=lk_lambda", "train.wandb_mode=disabled"]  # W&B: test_tau_probe's
    run_stage("train", *norm_flags)
    target = served[1] / "eval/llamacpp/target-f32.gguf"
    run_stage("eval", *norm_flags, f"eval.target_gguf={target}", "--engine", "llamacpp", "--prompts", str(prompts),
              "--concurrency", "1")
    return norm_run, json.loads((norm_run / "eval/report.json").read_text())


@pytest.fixture(scope="module")
def served_dflash(served, overfit_tiny, tmp_path_factory):
    """The overfit run's shards, a DFlash block drafter trained on them (block 4: 3 drafts a verification, K=3 as
    the EAGLE-3 drafter), converted by llama.cpp's DFlashModel and served with --spec-type draft-dflash beside the
    same target GGUF, one request in flight (two are the EAGLE-3 drafter's test: the same server code)."""
    _, run_dir, flags, prompts = overfit_tiny
    dflash_run = tmp_path_factory.mktemp("dflash") / "run"
    for stage_dir in ("conversations", "hidden"):
        shutil.copytree(run_dir / stage_dir, dflash_run / stage_dir)
    dflash_flags = [str(dflash_run) if f == str(run_dir) else f for f in flags] + [
        "train.drafter=dflash", "train.dflash.block_size=4", "train.dflash.anchors=8", "train.tau_every=0", "train.epochs=80",
        "train.lr=1e-2", "train.wandb_mode=disabled"]
    run_stage("train", *dflash_flags)
    target = served[1] / "eval/llamacpp/target-f32.gguf"
    run_stage("eval", *dflash_flags, f"eval.target_gguf={target}", "--engine", "llamacpp", "--prompts", str(prompts),
              "--concurrency", "1")
    return dflash_run, json.loads((dflash_run / "eval/report.json").read_text())


def test_llamacpp_accepts_what_our_engine_accepts(served):
    assert_engines_agree(served[3])


def test_llamacpp_accepts_what_our_engine_accepts_with_norm_before_fc(served_norm_before_fc):
    norm_run, report = served_norm_before_fc
    assert json.loads((norm_run / "drafter/config.json").read_text())["norm_before_fc"] is True
    assert json.loads((norm_run / "train/manifest.json").read_text())["settings"]["train.loss"] == "lk_lambda"
    assert_engines_agree(report)


def test_llamacpp_serves_a_dflash_drafter_as_our_engine_does(served_dflash):
    """DFlash: llama.cpp's converter and --spec-type draft-dflash take our export (target layers as trained), its
    outputs equal the base server's, and it accepts what our engine accepts block by block."""
    dflash_run, report = served_dflash
    config = json.loads((dflash_run / "drafter/config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["block_size"] == 4
    assert gguf_target_layers(next((dflash_run / "eval/llamacpp").glob("drafter-*.gguf"))) == [1, 2, 3]
    assert report["server"]["levels"][0]["outputs_equal"] == len(report["per_prompt"])
    assert_engines_agree(report)


def test_eval_compare_puts_the_two_families_side_by_side(served, served_dflash, tmp_path):
    eagle, dflash = served[1] / "eval", served_dflash[0] / "eval"
    run_stage("eval", "compare", str(eagle), str(dflash), "--out", str(tmp_path))
    table = (tmp_path / "compare.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith(f"| {eagle}") or line.startswith(f"| {dflash}")]
    assert [row.split(" | ")[1] for row in rows] == ["EAGLE-3", "DFlash"]
    assert "τ llama.cpp @1" in table and "τ llama.cpp @2" in table
    assert rows[1].endswith("| - | - | - |")  # DFlash ran at 1 request in flight only: its @2 cells say so
    wrong = run_stage("eval", "compare", str(eagle), str(served_dflash[0] / "train"), check=False)
    assert wrong.returncode == 1 and "not an eval report" in wrong.stderr.splitlines()[-1]
    # the family is the report's own record, not a look at a drafter dir that may have moved since
    moved = tmp_path / "moved"
    moved.mkdir()
    report = json.loads((dflash / "report.json").read_text())
    (moved / "report.json").write_text(json.dumps({**report, "drafter": str(tmp_path / "gone")}))
    run_stage("eval", "compare", str(eagle), str(moved), "--out", str(tmp_path))
    assert f"| {moved} | DFlash |" in (tmp_path / "compare.md").read_text()
    del report["drafter_family"]
    (moved / "report.json").write_text(json.dumps(report))
    older = run_stage("eval", "compare", str(eagle), str(moved), check=False)
    assert older.returncode == 1 and "no drafter_family recorded" in older.stderr.splitlines()[-1]


def assert_engines_agree(report: dict) -> None:
    hf = report["hf_engine"]
    assert hf["acceptance_length"] >= 1.8, "the drafter must be clearly above τ = 1, or agreement proves nothing"
    ours = same_output_prompts(report)
    assert len(ours) >= 8, f"only {len(ours)}/12 prompts have the same greedy text in both engines"
    level1 = report["server"]["levels"][0]
    assert level1["concurrency"] == 1 and level1["outputs_equal"] == 12  # llama.cpp spec == llama.cpp base
    theirs = llamacpp_accepted(level1["spec"]["rows"])
    equal = sum(theirs[i] == n for i, n in ours.items())
    assert equal >= 0.9 * len(ours), {i: (n, theirs[i]) for i, n in ours.items()}
    assert abs(sum(theirs[i] for i in ours) - sum(ours.values())) <= 0.05 * sum(ours.values())
    assert report["acceptance_length"] > 1.5 and report["engine"] == "llamacpp"


def test_report_shows_both_engines_per_concurrency_level(served):
    _, run_dir, _, report = served
    assert [lv["concurrency"] for lv in report["server"]["levels"]] == [1, 2]
    for lv in report["server"]["levels"]:
        assert lv["base"]["tokens_per_s"] > 0 and lv["spec"]["tokens_per_s"] > 0
        assert len(lv["per_position_acceptance"]) == 3 and lv["verifications"] > 0
        # llama-server's per-response timings: each request's own τ, averaged, beside the pooled counters' τ
        assert lv["per_request_acceptance_length"] == pytest.approx(lv["acceptance_length"], rel=0.15)
    md = (run_dir / "eval/report.md").read_text()
    assert "Served by llamacpp" in md and "ours (HF engine)" in md
    for png in ("acceptance.png", "throughput.png"):
        assert (run_dir / "eval" / png).stat().st_size > 10_000


def test_drafts_are_accepted_as_often_with_two_requests_in_flight(served):
    """Two slots drafting at once must not lower llama.cpp's acceptance: the same prompts at 1 and 2 in flight
    (llama.cpp b11434 samples drafts inside the drafter's graph by default, and with several slots that lost
    most accepted drafts; LlamaServer turns it off). Measured without that: τ 2.01 at 1 in flight, 1.51 at 2."""
    one, two = served[3]["server"]["levels"]
    assert two["concurrency"] == 2 and two["outputs_equal"] >= 10
    assert two["acceptance_length"] >= 0.95 * one["acceptance_length"], (one["acceptance_length"],
                                                                          two["acceptance_length"])


def test_aux_layers_read_one_off_break_the_agreement(served, tmp_path):
    """The same drafter with its top-level layer ids shifted by one: llama.cpp then feeds it the wrong
    residual streams, and the accepted counts must fall well below ours (so the first test can fail)."""
    cfg, run_dir, prompts, report = served
    shifted = tmp_path / "drafter"
    shutil.copytree(run_dir / "drafter", shifted)
    config = json.loads((shifted / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(config))
    cache = cache_root(cfg)
    gguf = convert_drafter(llamacpp_tree(cache), shifted, resolve_target(cfg), tmp_path / "shifted.gguf")
    assert gguf_target_layers(gguf) == config["eagle_aux_hidden_state_layer_ids"]
    ours = same_output_prompts(report)
    items = [(i, ids) for i, ids in eval_prompt_ids(cfg, load_tokenizer(cfg), str(prompts)) if i in ours]
    assert len(items) == len(ours)
    target = run_dir / "eval/llamacpp/target-f32.gguf"
    with LlamaServer(server_binary(cache), target, SpecDraft(gguf, k=3)) as url:
        theirs = llamacpp_accepted(run_level(url, items, 16, 1, "llamacpp")["rows"])
    assert sum(theirs.values()) < 0.8 * sum(ours.values()), (theirs, ours)


def test_p_min_reaches_llamacpp_and_keeps_its_outputs(served):
    """SpecDraft(p_min=...) is llama.cpp's own early stop: a draft whose probability is below p_min ends
    the chain. Above 1 no draft can pass, so the speculative server must draft nothing and still write
    what it writes with drafts (p_min 0, `served`'s level 1); this fails if the value never reaches it."""
    cfg, run_dir, prompts, report = served
    cache = cache_root(cfg)
    items = eval_prompt_ids(cfg, load_tokenizer(cfg), str(prompts))
    target, gguf = served_ggufs(run_dir)
    with LlamaServer(server_binary(cache), target, SpecDraft(gguf, k=3, p_min=1.01)) as url:
        rows = run_level(url, items, report["server"]["max_new_tokens"], 1, "llamacpp")["rows"]
    assert sum(r["timings"].get("draft_n", 0) for r in rows) == 0  # llama.cpp leaves the key out when it drafted nothing
    level1 = report["server"]["levels"][0]["spec"]["rows"]
    assert sum(r["timings"]["draft_n"] for r in level1) > 0  # the same server at p_min 0 drafted
    assert [r["text"] for r in rows] == [r["text"] for r in level1]


def test_llamacpp_stops_drafting_where_our_engine_stops_at_p_min(served):
    """eval.draft_p_min in both engines: llama.cpp ends a chain at a draft whose probability (softmax over its
    top 10) is below p_min, ours by the same rule (core.engine.speculative.draft_confidence). Per prompt whose greedy text
    both engines share, the drafts llama.cpp verified and accepted (timings.draft_n, draft_n_accepted) must
    equal ours on >= 90% of them, and p_min must have stopped chains in both (so the rule is exercised)."""
    from core.engine.speculative import Drafting, speculative_generate
    from eval.run import load_engine

    cfg, run_dir, prompts, report = served
    shared = same_output_prompts(report)
    model, tok, drafter, stop = load_engine(cfg, run_dir / "drafter")
    n, k, p_min = report["server"]["max_new_tokens"], 3, 0.9
    items = [(i, ids) for i, ids in eval_prompt_ids(cfg, tok, str(prompts)) if i in shared]
    ours = {i: speculative_generate(model, drafter, ids, n, stop, Drafting(k, p_min=p_min)) for i, ids in items}
    target, gguf = served_ggufs(run_dir)
    with LlamaServer(server_binary(cache_root(cfg)), target, SpecDraft(gguf, k, p_min)) as url:
        rows = run_level(url, items, n, 1, "llamacpp")["rows"]
    theirs = {r["id"]: (r["timings"].get("draft_n", 0), r["timings"].get("draft_n_accepted", 0)) for r in rows}
    mine = {i: (sum(g.drafted), sum(a - 1 for a in g.accept_lengths)) for i, g in ours.items()}
    equal = sum(theirs[i] == mine[i] for i in mine)
    assert equal >= 0.9 * len(mine), str({i: (mine[i], theirs[i]) for i in mine})
    rounds = sum(len(g.drafted) for g in ours.values())
    assert sum(d for d, _ in mine.values()) < k * rounds and sum(d for d, _ in theirs.values()) < k * rounds


def test_target_gguf_choice_follows_the_eval_keys(tmp_path):
    """eval.target_gguf wins; SmolLM2 serves its embedded Q4_1 file unless eval.target_outtype asks for a
    conversion (the f32 target is where a drafter pays on a CPU); other targets convert at that type or at
    the drafter's eval.gguf_outtype."""
    from core.target.model import SMOLLM2, embedded_gguf_path
    from eval.llamacpp_server import target_gguf_choice

    given = tmp_path / "t.gguf"
    assert target_gguf_choice(str(given), SMOLLM2, "f32", "q8_0") == (given, "")
    assert target_gguf_choice("", SMOLLM2, "", "q8_0") == (embedded_gguf_path(), "")
    assert target_gguf_choice("", SMOLLM2, "f32", "q8_0") == (None, "f32")
    assert target_gguf_choice("", "tiny-random-llama", "", "q8_0") == (None, "q8_0")
    assert target_gguf_choice("", "tiny-random-llama", "f16", "q8_0") == (None, "f16")


def test_one_server_at_a_time_reports_what_the_paired_run_reports(served, tmp_path):
    """eval.server_pass: the base llama-server alone (`--pass base`), stopped; then the speculative one alone
    (`--pass spec`), which writes the report. The same drafter, K and slots as `served`'s paired run: τ, the
    drafts counted and the outputs at each level must be the paired run's (greedy, so equal up to near-ties);
    a pass killed after its first level reruns only the other."""
    cfg, run_dir, prompts, paired = served
    target, gguf = served_ggufs(run_dir)
    binary, out = server_binary(cache_root(cfg)), tmp_path / "eval"
    flags = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(run_dir), "--engine", "server",
             "--server-type", "llamacpp", "--prompts", str(prompts), "--out", str(out), "eval.draft_steps=3",
             "eval.max_new_tokens=16", "eval.max_prompts=12"]
    with LlamaServer(binary, target, parallel=2) as url:
        run_stage("eval", *flags, "--pass", "base", "--base", url, "--concurrency", "1")
        first = json.loads((out / "passes/base.json").read_text())
        run_stage("eval", *flags, "--pass", "base", "--base", url, "--concurrency", "1,2")
    base = json.loads((out / "passes/base.json").read_text())
    assert base["levels"]["1"] == first["levels"]["1"] and list(base["levels"]) == ["1", "2"]  # level 1 kept
    assert not (out / "report.json").exists() and base["models"]  # no report until both passes ran
    with LlamaServer(binary, target, SpecDraft(gguf, k=3), parallel=2) as url:
        run_stage("eval", *flags, "--pass", "spec", "--spec", url, "--concurrency", "1,2")
    report = json.loads((out / "report.json").read_text())
    assert report["server"]["one_server_at_a_time"]["base"]["server"]["models"] == base["models"]
    for ours, theirs in zip(report["server"]["levels"], paired["server"]["levels"], strict=True):
        assert ours["concurrency"] == theirs["concurrency"] and ours["outputs_equal"] == theirs["outputs_equal"]
        assert ours["acceptance_length"] == pytest.approx(theirs["acceptance_length"], rel=0.03)
        assert ours["verifications"] == pytest.approx(theirs["verifications"], rel=0.05)
    assert report["outputs_match_baseline"] == paired["outputs_match_baseline"]
    assert "one at a time" in (out / "report.md").read_text()
