"""data_gen's `openai` backend against a scripted server on loopback (tests/fake_openai_server.py, a test
double): faults, exactly-once output, kill -9 resume, multi-turn on-policy history, reasoning, bad input."""

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from core.run.config import load_config
from core.storage.conversations import read_conversations
from core.target.model import load_tokenizer
from data_gen.generate import main
from data_gen.openai_client import backoff_delay, retry_after_seconds
from tests.conftest import ROOT, masked_spans, run_stage, wait_until
from tests.fake_openai_server import FakeOpenAIServer, scripted_answer

N_CONV = 40


def write_prompts(path, n=N_CONV, turns=2):
    """ShareGPT-style conversations with `turns` user turns (their original answers are discarded)."""
    with path.open("w") as f:
        for i in range(n):
            conv = []
            for t in range(turns):
                conv += [{"from": "human", "value": f"Question {t + 1} of conversation {i}?"},
                         {"from": "gpt", "value": "an old answer that must not survive"}]
            f.write(json.dumps({"id": f"c{i:03d}", "conversations": conv}) + "\n")
    return path


def flags(tmp_path, url, prompts, *extra):
    return [f"run_dir={tmp_path / 'run'}", "data_gen.backend=openai", f"data_gen.base_url={url}",
            f"data_gen.prompts={prompts}", "data_gen.heldout_percent=0", f"data_gen.num_samples={N_CONV}",
            "data_gen.max_turns=0", "data_gen.part_samples=4", "data_gen.concurrency=8",
            "data_gen.request_timeout=0.5", "data_gen.backoff_base=0.01", "data_gen.max_retries=12",
            "data_gen.max_new_tokens=12", *extra]


def check_on_policy(rows, tok):
    """Each answer is the server's reply to the regenerated history; masks cover exactly the answers."""
    for r in rows:
        msgs = [{"role": m["role"], "content": m["content"]} for m in r["messages"]]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert "old answer" not in json.dumps(msgs)
        expected = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                content, finish = scripted_answer(msgs[:i], 12)
                assert m["content"] == content
                expected.append(content + ("<|im_end|>" if finish == "stop" else ""))
        assert masked_spans(tok, r["input_ids"], r["loss_mask"]) == expected


def test_thirty_percent_faults_every_conversation_exactly_once(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    with FakeOpenAIServer(fault_rate=0.3, seed=1, slow_seconds=1.0) as server:
        cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", flags(tmp_path, server.url, prompts))
        main(cfg)
    faults = {k: v for k, v in server.counts.items() if k != "ok"}
    assert set(faults) == {"429", "500", "503", "timeout", "drop", "malformed"}, server.counts
    assert sum(faults.values()) / sum(server.counts.values()) > 0.2
    rows = list(read_conversations(tmp_path / "run/conversations"))
    ids = [r["conversation_id"] for r in rows]
    assert sorted(ids) == [f"c{i:03d}" for i in range(N_CONV)]  # every one, once
    check_on_policy(rows, load_tokenizer(cfg))
    summary = json.loads((tmp_path / "run/conversations/summary.json").read_text())
    assert sum(summary["errors_now"].values()) >= sum(faults.values())  # + any slow reply that timed out under load
    assert summary["generated_now"] == N_CONV and summary["ended_by_now"] == {"turns": N_CONV}


def test_kill9_at_random_moments_then_rerun_loses_and_duplicates_nothing(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    rng = random.Random(7)
    with FakeOpenAIServer(fault_rate=0.3, seed=2, latency=0.05, slow_seconds=1.0) as server:
        args = ["data_gen", "--config", "configs/smollm2-135m-instruct.yaml", *flags(tmp_path, server.url, prompts)]
        killed_mid_run, conv, log = 0, tmp_path / "run/conversations", tmp_path / "stderr"
        for attempt in range(3):
            with log.open("w") as err:
                proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stderr=err)
            # kill at a random moment once it is generating; the first launch only after its first part is
            # committed, so the rerun resumes past committed parts on a machine of any speed
            wait_until(lambda p=proc: p.poll() is not None or "to generate" in log.read_text(), "data_gen to start", 120)
            if attempt == 0:
                wait_until(lambda p=proc: p.poll() is not None or any(conv.glob("part-*.parquet")), "a committed part", 120)
            time.sleep(rng.uniform(0.0, 1.5))
            killed_mid_run += proc.poll() is None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert killed_mid_run >= 2
        assert any(conv.glob("part-*.parquet")), "no part was committed before the kills"
        # a part cut short by a kill, for certain (the random kills above may or may not leave one)
        (tmp_path / "run/conversations/.part-00099.parquet.tmp4194305").write_bytes(b"half a part")
        run_stage(*args)
    ids = Counter(read_conversations(tmp_path / "run/conversations")["conversation_id"])
    assert sorted(ids) == [f"c{i:03d}" for i in range(N_CONV)] and set(ids.values()) == {1}
    assert not list((tmp_path / "run/conversations").glob("*.tmp*"))


def test_api_key_is_sent_never_logged_and_401_stops_the_run(tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", n=4)
    env_key = "sk-test-SECRET-0123456789"
    monkeypatch.setenv("EAGLE3_TEST_KEY", env_key)
    with FakeOpenAIServer(status_override=401) as server:
        proc = run_stage("data_gen", *flags(tmp_path, server.url, prompts), "data_gen.api_key_env=EAGLE3_TEST_KEY",
                         check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("data_gen: error:") and "401" in last and "data_gen.base_url" in last
    assert env_key not in proc.stderr + proc.stdout
    assert server.auth_headers and set(server.auth_headers) == {f"Bearer {env_key}"}


def test_rejected_requests_are_counted_skips_not_crashes(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=4)
    with FakeOpenAIServer(status_override=400) as server:
        cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml",
                          flags(tmp_path, server.url, prompts, "data_gen.num_samples=4"))
        main(cfg)
    summary = json.loads((tmp_path / "run/conversations/summary.json").read_text())
    assert summary["errors_now"] == {"rejected": 4} and summary["output_skipped_now"] == {"no_answer": 4}


@pytest.mark.parametrize("mode", ["field", "render", "drop"])
def test_reasoning_modes(tmp_path, mode):
    prompts = write_prompts(tmp_path / "p.jsonl", n=3, turns=1)
    with FakeOpenAIServer(reasoning="Let me think step by step.") as server:
        cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml",
                          flags(tmp_path, server.url, prompts, "data_gen.num_samples=3", f"data_gen.reasoning={mode}",
                                "data_gen.max_new_tokens=64"))
        main(cfg)
    tok = load_tokenizer(cfg)
    for r in read_conversations(tmp_path / "run/conversations"):
        answer = r["messages"][-1]
        spans = masked_spans(tok, r["input_ids"], r["loss_mask"])
        if mode == "render":  # ChatML has no reasoning field: an inline think block, trained on
            assert answer["content"].startswith("<think>\nLet me think step by step.\n</think>\n\nTurn 1")
            assert spans == [answer["content"] + "<|im_end|>"]
        else:
            assert answer["reasoning_content"] == ("Let me think step by step." if mode == "field" else "")
            assert spans == [answer["content"] + "<|im_end|>"] and "step by step" not in tok.decode(r["input_ids"])


def test_truncated_answers_are_flagged_and_filterable(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=8, turns=1)
    with FakeOpenAIServer() as server:
        base = flags(tmp_path, server.url, prompts, "data_gen.num_samples=8", "data_gen.max_new_tokens=8")
        main(load_config(ROOT / "configs/smollm2-135m-instruct.yaml", base))
        kept = read_conversations(tmp_path / "run/conversations")
        truncated = {r["conversation_id"] for r in kept if r["finish_reason"] == "length"}
        assert 0 < len(truncated) < 8
        main(load_config(ROOT / "configs/smollm2-135m-instruct.yaml",
                         [*base, f"run_dir={tmp_path / 'run2'}", "data_gen.drop_truncated=true"]))
    dropped = read_conversations(tmp_path / "run2/conversations")
    assert set(dropped["conversation_id"]) == set(kept["conversation_id"]) - truncated


def test_bad_prompt_file_strict_names_the_line_skip_counts(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=4, turns=1)
    lines = prompts.read_text().splitlines()
    lines[1:1] = ['{"id": "broken", ', '{"id": "x", "conversations": [{"from": "robot", "value": "hi"}]}',
                  '{"id": "y", "conversations": [{"from": "human", "value": 42}]}', '{"id": "z", "conversations": []}']
    prompts.write_text("\n".join(lines) + "\n")
    with FakeOpenAIServer() as server:
        proc = run_stage("data_gen", *flags(tmp_path, server.url, prompts), check=False)
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1] == (
            f"data_gen: error: {prompts}:2: malformed JSON (Expecting property name enclosed in double quotes "
            "at column 18)")
        assert not (tmp_path / "run/conversations").exists()  # nothing written before the input is read
        run_stage("data_gen", *flags(tmp_path, server.url, prompts, "data_gen.on_bad_record=skip"))
    summary = json.loads((tmp_path / "run/conversations/summary.json").read_text())
    assert summary["input_skipped"] == {"malformed_json": 1, "unknown_role": 1, "bad_value": 1,
                                        "empty_conversation": 1}
    assert summary["generated_now"] == 4


def test_backoff_waits_at_least_retry_after():
    rng = random.Random(0)
    assert all(backoff_delay(a, 1.0, 60.0, None, rng) <= min(60.0, 2 ** a) for a in range(10))
    assert all(backoff_delay(a, 0.01, 60.0, 7.0, rng) >= 7.0 for a in range(5))
    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    from email.utils import formatdate
    assert 8 <= retry_after_seconds(formatdate(time.time() + 10, usegmt=True)) <= 10
