"""data_gen's `openai` backend against a real OpenAI-compatible server: llama.cpp serving the embedded
SmolLM2 GGUF on loopback: the real llama-server b11434 (eval/llamacpp_build.py, which `make test` starts)."""

import json

import pytest

from core.run.config import load_config
from core.storage.conversations import read_conversations
from core.target.model import load_tokenizer
from core.target.prompts import load_sharegpt
from data_gen.generate import main
from eval.llamacpp_server import embedded_target_server
from tests.conftest import ROOT, masked_spans


@pytest.fixture(scope="module")
def server_url():
    with embedded_target_server(n_ctx=1024, parallel=4) as url:
        yield url


def test_regenerates_multi_turn_sharegpt_conversations_on_policy(server_url, tmp_path):
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [
        f"run_dir={tmp_path / 'run'}", "data_gen.backend=openai", f"data_gen.base_url={server_url}",
        "data_gen.max_turns=2", "data_gen.num_samples=8", "data_gen.max_prompt_tokens=96",
        "data_gen.max_new_tokens=40", "data_gen.concurrency=4", "data_gen.part_samples=4"])
    main(cfg)
    tok = load_tokenizer(cfg)
    rows = list(read_conversations(tmp_path / "run/conversations"))
    assert len({r["conversation_id"] for r in rows}) == 8
    originals = {p.id: p for p in load_sharegpt()[0]}
    multi_turn = 0
    for r in rows:
        msgs = [{"role": m["role"], "content": m["content"]} for m in r["messages"]]
        source = originals[r["conversation_id"]]
        users = [m["content"] for m in source.messages if m["role"] == "user"]
        assert [m["content"] for m in msgs if m["role"] == "user"] == users[:2]
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert not set(answers) & {m["content"] for m in source.messages if m["role"] == "assistant"}
        multi_turn += len(answers) == 2
        # the mask: exactly each regenerated answer (+ <|im_end|> when it was not cut at max_tokens)
        spans = masked_spans(tok, r["input_ids"], r["loss_mask"])
        assert [s.removesuffix("<|im_end|>") for s in spans] == answers
        assert tok.decode(r["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False)
    assert multi_turn >= 4  # ShareGPT has single-turn conversations too
    summary = json.loads((tmp_path / "run/conversations/summary.json").read_text())
    assert summary["generated_now"] == 8 and summary["errors_now"] == {}


def test_self_written_prompts_come_from_the_server_and_are_answered_there(server_url, tmp_path):
    """data_gen.self_prompts through the openai backend: the user header as a raw-text /v1/completions prompt
    (llama-server parses its special tokens), batches of `concurrency` seeded requests, then answered as chats."""
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [
        f"run_dir={tmp_path / 'run'}", "data_gen.backend=openai", f"data_gen.base_url={server_url}",
        "data_gen.num_samples=2", "data_gen.self_prompts=4", "data_gen.max_new_tokens=16", "data_gen.concurrency=4",
        "data_gen.part_samples=8"])
    main(cfg)
    own = [json.loads(line) for line in (tmp_path / "run/conversations/self_prompts.jsonl").read_text().splitlines()]
    assert len(own) >= 4 and all("<|im_" not in r["prompt"] and r["id"].startswith("self-") for r in own)
    rows = {r["conversation_id"]: r for r in read_conversations(tmp_path / "run/conversations")}
    asked = {i: r["messages"][0]["content"] for i, r in rows.items() if i.startswith("self-")}
    assert asked == {r["id"]: r["prompt"] for r in own[:4]}
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in rows.values())
    assert len(rows) == 6
