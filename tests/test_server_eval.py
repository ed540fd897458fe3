"""`python -m eval --engine server` against vLLM and SGLang test doubles (tests/fake_spec_server.py: their
documented client fields, scripted acceptance), and the counter parsers on their own."""

import ast
import copy
import json
import warnings

import pytest

from core.run.errors import UserError
from eval.report import write_report
from eval.spec_counters import counter_window, per_request_tau, prometheus_spec_counters, sglang_window
from tests.conftest import ROOT, run_stage
from tests.fake_spec_server import FakeSpecServer, rounds
from tests.vllm_source import COMPLETION_PROTOCOL_FILE, VLLM

K = 3
N = 12


BASE_PROTOCOL_FILE = "entrypoints/generate/base/protocol.py"
METRICS_FILE = "v1/metrics/stats.py"
OBSERVABILITY_FILE = "config/observability.py"


def expected(num_prompts: int) -> tuple[float, list[float]]:
    """τ and per-position acceptance the scripted servers must report for num_prompts answers of N tokens."""
    steps = rounds(N, K) * num_prompts
    return (sum(steps) / len(steps), [sum(t - 1 > i for t in steps) / len(steps) for i in range(K)])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eval_server_reports_the_engines_own_counts(engine, tmp_path):
    out = tmp_path / "eval"
    with FakeSpecServer(engine, False, K) as base, FakeSpecServer(engine, True, K, per_request_metrics=True) as spec:
        run_stage("eval", "--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "run"),
                "--engine", "server", "--server-type", engine, "--base", base.url, "--spec", spec.url,
                "--prompts", str(ROOT / "tests/data/mt_bench_3.jsonl"), "--max-new-tokens", str(N),
                "--concurrency", "1,3", "--out", str(out), f"eval.draft_steps={K}")
    r = json.loads((out / "report.json").read_text())
    tau, per_pos = expected(3)
    # the servers took turns: a warm-up each, then at 1 in flight prompt by prompt (who goes first swapped each
    # time), at 3 in flight one block of all three prompts each
    order = "".join(name for _, name in sorted([(t, "B") for t in base.arrivals] + [(t, "S") for t in spec.arrivals]))
    assert order == "BS" + "BSSBBS" + "BBBSSS"
    assert r["engine"] == "server" and r["num_prompts"] == 3 and r["outputs_match_baseline"] is True
    assert [lv["concurrency"] for lv in r["server"]["levels"]] == [1, 3]
    for lv in r["server"]["levels"]:
        if engine == "vllm":  # counted from Prometheus deltas over this level only, both DP engines summed
            assert lv["acceptance_length"] == pytest.approx(tau)
            assert lv["per_position_acceptance"] == pytest.approx(per_pos)
            assert lv["per_request_acceptance_length"] == pytest.approx(tau)  # equal answers: the pooled one
        else:  # SGLang's own rule: completion_tokens / spec_verify_ct, the prefill token included
            assert lv["acceptance_length"] == pytest.approx(N / len(rounds(N, K)))
            assert lv["per_position_acceptance"] is None
            assert lv["per_request_acceptance_length"] == pytest.approx(N / len(rounds(N, K)))  # equal answers
        assert lv["outputs_equal"] == 3 and lv["base"]["output_tokens"] == 3 * N
        assert all(row["ttft_s"] <= row["latency_s"] for row in lv["spec"]["rows"])
    assert "Served by " + engine in (out / "report.md").read_text()
    assert "τ pooled (engine's counters) | τ per request (mean)" in (out / "report.md").read_text()
    assert (out / "throughput.png").stat().st_size > 10_000
    # a server whose outputs differed: the report says so from its levels (no HF per-prompt fields here)
    r.pop("per_prompt")
    r["outputs_match_baseline"], r["server"]["levels"][0]["outputs_equal"] = False, 2
    with warnings.catch_warnings():  # e.g. an empty legend: SGLang's report has no per-position bars to label
        warnings.simplefilter("error")
        write_report(tmp_path / "differ", r, [])
    md = (tmp_path / "differ" / "report.md").read_text()
    assert "| outputs identical to the baseline | False |" in md and "prompts identical" not in md


def test_eval_server_needs_both_urls_and_leaves_the_given_config_alone(tiny_cfg):
    from eval.run import main

    before = copy.deepcopy(tiny_cfg)
    with pytest.raises(UserError, match="needs both --base URL and --spec URL"):
        main(tiny_cfg, engine="server", base_url="http://127.0.0.1:9", max_prompts=2)
    assert tiny_cfg == before  # CLI flags go into eval's own copy


def test_prometheus_counters_sum_series_and_window():
    page = "\n".join([
        "# HELP llamacpp:spec_decode_num_drafts_total drafts", "# TYPE llamacpp:spec_decode_num_drafts_total counter",
        "llamacpp:spec_decode_num_drafts_total 10", "llamacpp:spec_decode_num_draft_tokens_total 30",
        "llamacpp:spec_decode_num_accepted_tokens_total 12",
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7',
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1',
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4',
        "vllm:spec_decode_num_drafts_total 999", "llamacpp:n_busy_slots_per_decode 1"])
    c = prometheus_spec_counters(page, "llamacpp:")
    assert c == {"drafts": 10, "draft_tokens": 30, "accepted": 12, "accepted_per_pos": [7, 4, 1]}
    zero = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    w = counter_window(zero, c)
    assert w["acceptance_length"] == pytest.approx(2.2) and w["per_position_acceptance"] == pytest.approx([.7, .4, .1])
    with pytest.raises(ValueError, match="made no drafts"):
        counter_window(c, c)


def test_sglang_window_refuses_a_server_without_speculation():
    assert sglang_window([{"completion_tokens": 10, "spec_verify_ct": 4}, {"completion_tokens": 6, "spec_verify_ct": 4}]
                         )["acceptance_length"] == 2.0
    with pytest.raises(ValueError, match="no spec_verify_ct"):
        sglang_window([{"completion_tokens": 10}])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_one_server_at_a_time_gives_the_paired_runs_counts(engine, tmp_path):
    """--pass base against the base double alone, then --pass spec against the speculative one alone: the report
    has the engine's own counts as a paired run has them, and each pass names its server's model."""
    flags = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "run"), "--engine", "server",
             "--server-type", engine, "--prompts", str(ROOT / "tests/data/mt_bench_3.jsonl"), "--max-new-tokens",
             str(N), "--concurrency", "1,3", "--out", str(tmp_path / "eval"), f"eval.draft_steps={K}"]
    with FakeSpecServer(engine, False, K) as base:
        run_stage("eval", *flags, "--pass", "base", "--base", base.url)
    assert not (tmp_path / "eval/report.json").exists()
    with FakeSpecServer(engine, True, K) as spec:
        run_stage("eval", *flags, "--pass", "spec", "--spec", spec.url)
    r = json.loads((tmp_path / "eval/report.json").read_text())
    tau, per_pos = expected(3)
    assert r["outputs_match_baseline"] is True and [lv["concurrency"] for lv in r["server"]["levels"]] == [1, 3]
    for lv in r["server"]["levels"]:
        want = tau if engine == "vllm" else N / len(rounds(N, K))
        assert lv["acceptance_length"] == pytest.approx(want) and lv["outputs_equal"] == 3
    assert r["server"]["one_server_at_a_time"]["spec"]["server"]["models"] == ["/models/target"]


def test_passes_of_two_different_targets_are_not_combined(tmp_path):
    flags = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "run"), "--engine", "server",
             "--server-type", "vllm", "--prompts", str(ROOT / "tests/data/mt_bench_3.jsonl"), "--max-new-tokens",
             str(N), "--concurrency", "1", "--out", str(tmp_path / "eval")]
    with FakeSpecServer("vllm", False, K) as base:
        run_stage("eval", *flags, "--pass", "base", "--base", base.url)
    with FakeSpecServer("vllm", True, K, model="/models/another") as spec:
        proc = run_stage("eval", *flags, "--pass", "spec", "--spec", spec.url, check=False)
    assert proc.returncode == 1 and "both passes must run the same target" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "eval/report.json").exists()
    proc = run_stage("eval", *flags, "--pass", "spec", check=False)  # a pass needs its server's URL
    assert proc.returncode == 1 and "give --spec URL" in proc.stderr.splitlines()[-1]


def test_tau_per_request_is_the_mean_of_each_requests_own_tau_not_the_pooled_one():
    """Two answers of unequal length: pooled τ (Σ tokens / Σ verifications) weighs the long one more; the per-request
    mean (SpecForge's) does not. SGLang from meta_info, llama.cpp from its per-response timings (each verification
    emits its accepted drafts plus one token), vLLM none."""
    sglang = [{"meta_info": {"completion_tokens": 10, "spec_verify_ct": 5}},
              {"meta_info": {"completion_tokens": 30, "spec_verify_ct": 10}}]
    assert sglang_window([r["meta_info"] for r in sglang])["acceptance_length"] == pytest.approx(40 / 15)
    assert per_request_tau(sglang, "sglang") == pytest.approx((2.0 + 3.0) / 2)
    llamacpp = [{"timings": {"predicted_n": 12, "draft_n": 20, "draft_n_accepted": 6}},
                {"timings": {"predicted_n": 20, "draft_n": 30, "draft_n_accepted": 15}}]
    assert per_request_tau(llamacpp, "llamacpp") == pytest.approx((12 / 6 + 20 / 5) / 2)
    vllm = [{"metrics": {"speculative_decoding": {"num_spec_steps": 4, "num_accepted_draft_tokens": 4}}},
            {"metrics": {"speculative_decoding": {"num_spec_steps": 10, "num_accepted_draft_tokens": 20}}}]
    assert per_request_tau(vllm, "vllm") == pytest.approx((2.0 + 3.0) / 2)
    assert per_request_tau([{"metrics": None}], "vllm") is None  # a server started without the flag


def test_vllm_per_request_counts_are_what_vllm_0_33_sends():
    """The fields per_request_tau reads from a vLLM answer, its flag and its τ rule, in vLLM's own source."""
    fields = {n.target.id for n in VLLM.cls(BASE_PROTOCOL_FILE, "SpeculativeDecodingMetrics").body
              if isinstance(n, ast.AnnAssign)}
    assert {"num_spec_steps", "num_accepted_draft_tokens", "mean_acceptance_length"} <= fields
    assert "metrics" in {n.target.id for n in VLLM.cls(COMPLETION_PROTOCOL_FILE, "CompletionStreamResponse").body
                         if isinstance(n, ast.AnnAssign)}
    assert "mean_al = 1.0 + num_accepted / num_spec_steps if num_spec_steps else 1.0" in VLLM.text(METRICS_FILE)
    assert 'per_request_spec_decode_metrics: Literal["none", "summary", "detailed"] = "none"' in VLLM.text(
        OBSERVABILITY_FILE)
