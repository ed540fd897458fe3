"""data_gen.self_prompts (data_gen/self_prompts.py): user turns sampled from the target's own user header, then
answered like any prompt. The header against the real SmolLM2 template; filtering, resume and giving up with a
scripted sampler (a test double); and the whole of data_gen with the real SmolLM2 target on the CPU."""

import pyarrow.parquet as pq
import pytest

from core.run.config import load_config
from core.run.errors import UserError
from core.storage.atomic_io import read_jsonl
from core.target.chat import prompt_ids
from core.target.model import load_tokenizer
from data_gen import generate
from data_gen.self_prompts import MAX_BATCH_FACTOR, self_prompts, user_header
from tests.conftest import ROOT

SPECIAL = {"<|im_start|>", "<|im_end|>"}


def test_the_user_header_is_what_every_templated_user_turn_starts_with(smol_cfg):
    tok = load_tokenizer(smol_cfg)
    text = user_header(tok)
    assert text.endswith("<|im_end|>\n<|im_start|>user\n"), text
    header = tok(text, add_special_tokens=False)["input_ids"]
    for text in ("What is a haiku?", "write me a poem\n  about cats"):  # stripped, as usable_turn keeps them
        ids = prompt_ids(tok, [{"role": "user", "content": text}])
        assert ids[:len(header)] == header
        assert tok.decode(ids[len(header):]).startswith(text)


def scripted(batches: dict[int, list[str | None]], calls: list[int], stop_at: int | None = None):
    """A test double for HFBackend.user_turns: batch `index`'s texts from a script, each call recorded;
    batch `stop_at` raises in place of a kill."""
    def sample(index: int) -> list[str | None]:
        if index == stop_at:
            raise KeyboardInterrupt
        calls.append(index)
        return batches.get(index, [None] * 4)
    return sample


BATCHES = {0: ["How do I bake bread?", None, "hi", "How  do i bake BREAD?"],  # cut off, too short, a repeat
           1: ["Tell me about <|im_start|> tokens", "Explain the moon landing.", "Write a poem about rain.", None],
           2: ["What is the capital of France?", "Name three colours please.", "Explain the moon landing.", None],
           3: ["Give me a list of fruits.", "Describe a cat in five words.", None, None]}


def test_usable_distinct_turns_in_batch_order_with_stable_ids(tmp_path):
    calls = []
    got = self_prompts(tmp_path / "s.jsonl", 4, scripted(BATCHES, calls), 4, SPECIAL)
    assert calls == [0, 1, 2]
    assert [p.messages[0]["content"] for p in got] == [
        "How do I bake bread?", "Explain the moon landing.", "Write a poem about rain.",
        "What is the capital of France?"]
    assert [p.id for p in got] == ["self-00000-000", "self-00001-001", "self-00001-002", "self-00002-000"]
    assert all(p.messages == [{"role": "user", "content": p.messages[0]["content"]}] for p in got)
    assert len(read_jsonl(tmp_path / "s.jsonl")) == 5  # the whole last batch is kept, for a later, larger n


def test_a_killed_run_keeps_its_batches_and_a_rerun_continues_to_the_same_prompts(tmp_path):
    path, calls = tmp_path / "s.jsonl", []
    with pytest.raises(KeyboardInterrupt):
        self_prompts(path, 5, scripted(BATCHES, calls, stop_at=2), 4, SPECIAL)
    assert [r["batch"] for r in read_jsonl(path)] == [0, 1, 1]
    calls = []
    got = self_prompts(path, 5, scripted(BATCHES, calls), 4, SPECIAL)
    assert calls == [2]  # batches 0 and 1 are not sampled again
    whole = self_prompts(tmp_path / "whole.jsonl", 5, scripted(BATCHES, []), 4, SPECIAL)
    assert [(p.id, p.messages) for p in got] == [(p.id, p.messages) for p in whole]
    calls = []
    assert self_prompts(path, 3, scripted(BATCHES, calls), 4, SPECIAL)[-1].id == "self-00001-002"
    assert calls == []  # enough are already there


def test_a_target_that_never_ends_a_user_turn_is_an_error_not_a_loop(tmp_path):
    calls = []
    with pytest.raises(UserError, match="wrote only 0 usable user turns"):
        self_prompts(tmp_path / "s.jsonl", 6, scripted({}, calls), 4, SPECIAL)
    assert len(calls) == MAX_BATCH_FACTOR * 2


def test_the_dataset_backend_has_no_answers_to_self_written_prompts(smol_cfg):
    smol_cfg.data_gen.self_prompts, smol_cfg.data_gen.backend = 4, "dataset"
    with pytest.raises(UserError, match="self_prompts = 4 with data_gen.backend = dataset"):
        generate.check_options(smol_cfg)


def test_data_gen_answers_what_the_real_target_asked_itself(tmp_path, monkeypatch):
    """SmolLM2 on the CPU: 2 ShareGPT conversations + 3 of its own user turns (batches of 8, T=1, at most 48
    tokens each here), answered in 4 tokens. A rerun resumes with nothing left to do; another temperature is
    another setting."""
    monkeypatch.setattr(generate, "MAX_TURN_TOKENS", 48)
    over = [f"run_dir={tmp_path / 'run'}", "data_gen.num_samples=2", "data_gen.self_prompts=3",
            "data_gen.batch_size=8", "data_gen.max_new_tokens=4", "data_gen.part_samples=8", "threads=1"]
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", over)
    out = generate.main(cfg)
    own = read_jsonl(out / "self_prompts.jsonl")
    assert len(own) >= 3 and len({r["prompt"] for r in own}) == len(own)
    rows = pq.read_table(out / "part-00000.parquet").to_pylist()
    asked = {r["id"]: r["messages"][-2]["content"] for r in rows}
    assert len(rows) == 5 and sum(i.startswith("self-") for i in asked) == 3
    assert {asked[r["id"]] for r in own[:3]} == {r["prompt"] for r in own[:3]}
    assert all(r["messages"][-1]["role"] == "assistant" and any(r["loss_mask"]) for r in rows)
    assert generate.main(load_config(ROOT / "configs/smollm2-135m-instruct.yaml", over)) == out
    assert sorted(p.name for p in out.glob("part-*.parquet")) == ["part-00000.parquet"]
    with pytest.raises(UserError, match="self_prompt_temperature"):
        generate.main(load_config(ROOT / "configs/smollm2-135m-instruct.yaml",
                                  [*over, "data_gen.self_prompt_temperature=0.7"]))
