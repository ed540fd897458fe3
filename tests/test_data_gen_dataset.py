"""data_gen.backend=dataset: the source's own answers, through every other part of data_gen unchanged (selection
and held-out split, turns, context cut, tokenization and loss mask, parts and resume). Real inputs: the embedded
ShareGPT or small ShareGPT-format jsonl files; the tiny target's tokenizer (SmolLM2's ChatML)."""

import json

import pyarrow.parquet as pq
import pytest

from core.run.config import load_config
from core.storage.conversations import part_files, read_conversations
from core.target.chat import prompt_ids
from core.target.model import load_tokenizer
from core.target.prompts import load_prompts
from data_gen import generate
from tests.conftest import ROOT, masked_spans, run_stage

EOT = "<|im_end|>"
LONG = "A long answer that goes on. " * 20  # 140 tokens: turn 2 of its conversation no longer fits 160
SOURCE = {  # id -> ShareGPT turns (human/gpt alternate unless said otherwise)
    "three": ["Hi?", "Short one.", "Q2?", "Short two.", "Q3?", "Short three."],
    "unanswered": ["Hello?", "Answered.", "Q2 has no answer?"],
    "first_unanswered": ["Hey?", "human:Hey again?", "gpt:An answer to the second."],
    "long": ["Tell me more?", LONG, "Q2?", "Never reached."],
    "emoji": ["Faces?", "Sure 😀😀😀 done, and then some more words after the faces."],
}


def write_source(path, source=SOURCE):
    with path.open("w") as f:
        for cid, turns in source.items():
            conv = []
            for i, t in enumerate(turns):
                role, _, text = t.partition(":") if t.startswith(("human:", "gpt:")) else ("", "", t)
                conv.append({"from": role or ("human", "gpt")[i % 2], "value": text})
            f.write(json.dumps({"id": cid, "conversations": conv}) + "\n")
    return path


def config(tmp_path, prompts, *extra, run="run"):
    return load_config(ROOT / "configs/tiny-random-llama.yaml", [
        f"run_dir={tmp_path / run}", "data_gen.backend=dataset", f"data_gen.prompts={prompts}",
        "data_gen.heldout_percent=0", "data_gen.max_turns=0", "data_gen.max_new_tokens=512",
        "data_gen.max_context_tokens=160", *extra])


def rows_by_id(cfg) -> dict[str, dict]:
    return {r["conversation_id"]: r for r in read_conversations(cfg.run_path / "conversations")}


def summary(cfg) -> dict:
    return json.loads((cfg.run_path / "conversations/summary.json").read_text())


def answers(row) -> list[str]:
    return [m["content"] for m in row["messages"] if m["role"] == "assistant"]


def test_rows_hold_the_sharegpt_answers_and_train_only_on_them(tmp_path, monkeypatch):
    monkeypatch.setattr(generate, "load_target", lambda cfg: pytest.fail("the dataset backend loaded the target"))
    cfg = config(tmp_path, "sharegpt", "data_gen.num_samples=24", "data_gen.max_new_tokens=100000",
                 "data_gen.max_context_tokens=100000", "data_gen.heldout_percent=2")
    generate.main(cfg)
    tok, source = load_tokenizer(cfg), {p.id: p.messages for p in load_prompts("sharegpt", "train", 2)}
    rows = list(read_conversations(cfg.run_path / "conversations"))
    assert len(rows) == 24 and sum(r["turns"] for r in rows) > 48  # multi-turn: max_turns=0 keeps every answer
    for r in rows:
        msgs = [{k: v for k, v in m.items() if v} for m in r["messages"]]
        assert msgs == source[r["conversation_id"]][:len(msgs)] and msgs[-1]["role"] == "assistant"
        # trained on: each answer and its end-of-turn token, turn by turn, and nothing else
        assert masked_spans(tok, r["input_ids"], r["loss_mask"]) == [a + EOT for a in answers(r)]
        assert r["finish_reason"] == "stop" and r["turns"] == len(answers(r))


def test_the_same_conversations_and_held_out_ids_as_the_hf_backend(tmp_path):
    common = ["data_gen.prompts=sharegpt", "data_gen.num_samples=8", "data_gen.max_turns=1",
              "data_gen.heldout_percent=30"]
    hf = load_config(ROOT / "configs/tiny-random-llama.yaml", [f"run_dir={tmp_path / 'hf'}", *common])
    dataset = load_config(ROOT / "configs/tiny-random-llama.yaml",
                          [f"run_dir={tmp_path / 'ds'}", *common, "data_gen.backend=dataset"])
    generate.main(hf)
    generate.main(dataset)
    ids = set(rows_by_id(dataset))
    assert ids == set(rows_by_id(hf)) and len(ids) == 8
    train = {p.id for p in load_prompts("sharegpt", "train", 30)}
    assert ids <= train  # 30% held out


@pytest.mark.parametrize("max_turns", [0, 2])
def test_turns_context_and_missing_answers_end_conversations_where_expected(tmp_path, max_turns):
    cfg = config(tmp_path, write_source(tmp_path / "p.jsonl"), f"data_gen.max_turns={max_turns}")
    generate.main(cfg)
    rows, tok = rows_by_id(cfg), load_tokenizer(cfg)
    three = ["Short one.", "Short two.", "Short three."][:max_turns or 3]
    assert {i: answers(r) for i, r in rows.items()} == {
        "three": three, "unanswered": ["Answered."], "long": [LONG], "emoji": [SOURCE["emoji"][1]]}
    assert summary(cfg)["ended_by_now"] == {"turns": 2, "unanswered": 1, "context": 1}
    assert summary(cfg)["output_skipped_now"] == {"no_answer": 1}  # first_unanswered: no answer to its first turn
    # the cut is where it should be: long's 2nd prompt is over 160 tokens, three's 3rd is not
    long_2 = [*rows["long"]["messages"], {"role": "user", "content": "Q2?"}]
    three_last = [{k: m[k] for k in ("role", "content")} for m in rows["three"]["messages"][:-1]]
    assert len(prompt_ids(tok, long_2)) > 160 >= len(prompt_ids(tok, three_last))
    for r in rows.values():
        assert masked_spans(tok, r["input_ids"], r["loss_mask"]) == [a + EOT for a in answers(r)]


def test_max_new_tokens_cuts_an_answer_and_flags_it_length(tmp_path):
    cfg = config(tmp_path, write_source(tmp_path / "p.jsonl"), "data_gen.max_new_tokens=4",
                 "data_gen.max_context_tokens=100000")
    generate.main(cfg)
    rows, tok = rows_by_id(cfg), load_tokenizer(cfg)
    ids = tok(SOURCE["emoji"][1], add_special_tokens=False)["input_ids"]
    # 4 tokens end inside the second face: the cut keeps whole characters, 3 tokens
    assert tok.decode(ids[:4]) == "Sure 😀\ufffd" and answers(rows["emoji"]) == ["Sure 😀"]
    assert len(tok("A long answer that", add_special_tokens=False)["input_ids"]) == 4
    assert answers(rows["long"]) == ["A long answer that", "Never reached."]  # the 2nd: 3 tokens, whole
    assert answers(rows["three"]) == ["Short one.", "Short two.", "Short three."]
    assert {i: r["finish_reason"] for i, r in rows.items()} == {
        "three": "stop", "unanswered": "stop", "long": "length", "emoji": "length"}
    # a cut answer never emitted its end-of-turn token: not trained on
    assert masked_spans(tok, rows["long"]["input_ids"], rows["long"]["loss_mask"]) == [
        "A long answer that", "Never reached." + EOT]
    assert masked_spans(tok, rows["emoji"]["input_ids"], rows["emoji"]["loss_mask"]) == ["Sure 😀"]


def test_a_rerun_writes_nothing_new_and_more_samples_add_only_the_rest(tmp_path):
    cfg = config(tmp_path, "sharegpt", "data_gen.num_samples=6", "data_gen.part_samples=2")
    generate.main(cfg)
    conv = cfg.run_path / "conversations"
    before = {p.name: p.read_bytes() for p in part_files(conv)}
    generate.main(cfg)
    assert {p.name: p.read_bytes() for p in part_files(conv)} == before and summary(cfg)["generated_now"] == 0
    first = set(rows_by_id(cfg))
    grown = config(tmp_path, "sharegpt", "data_gen.num_samples=10", "data_gen.part_samples=2")
    generate.main(grown)
    assert {p.name: p.read_bytes() for p in part_files(conv) if p.name in before} == before  # old parts untouched
    ids = [i for p in part_files(conv) for i in pq.read_table(p, columns=["conversation_id"])["conversation_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == 10 and first < set(ids) and summary(grown)["generated_now"] == 4


def test_another_backend_in_the_same_run_dir_is_refused_in_one_line(tmp_path):
    prompts = write_source(tmp_path / "p.jsonl")
    flags = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "run"),
             f"data_gen.prompts={prompts}", "data_gen.heldout_percent=0"]
    run_stage("data_gen", *flags, "data_gen.backend=dataset")
    manifest = (tmp_path / "run/conversations/manifest.json").read_bytes()
    proc = run_stage("data_gen", *flags, check=False)  # the config's backend: hf
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("data_gen: error: ")
    assert "data_gen.backend: 'dataset' -> 'hf'" in proc.stderr.splitlines()[-1] and "--fresh" in proc.stderr
    assert (tmp_path / "run/conversations/manifest.json").read_bytes() == manifest


@pytest.mark.parametrize("mode", ["drop", "field", "render"])
def test_source_reasoning_follows_data_gen_reasoning(tmp_path, mode):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "inline", "conversations": [
        {"from": "human", "value": "Q?"}, {"from": "gpt", "value": "<think>\nPonder.\n</think>\n\nAnswer."}]}) + "\n"
        + json.dumps({"id": "field", "conversations": [
            {"from": "human", "value": "Q?"}, {"from": "gpt", "value": "Answer.", "reasoning_content": "Ponder."}]}))
    cfg = config(tmp_path, path, f"data_gen.reasoning={mode}")
    generate.main(cfg)
    tok = load_tokenizer(cfg)
    for r in rows_by_id(cfg).values():
        answer = r["messages"][-1]
        spans = masked_spans(tok, r["input_ids"], r["loss_mask"])
        if mode == "render":  # ChatML has no reasoning field: an inline think block, trained on
            assert answer["content"] == "<think>\nPonder.\n</think>\n\nAnswer." and spans == [answer["content"] + EOT]
        else:
            assert answer == {"role": "assistant", "content": "Answer.",
                              "reasoning_content": "Ponder." if mode == "field" else ""}
            assert spans == ["Answer." + EOT] and "Ponder" not in tok.decode(r["input_ids"])


def test_prompts_without_answers_or_several_answers_per_turn_are_refused(tmp_path):
    mt_bench = ROOT / "tests/data/mt_bench_3.jsonl"
    proc = run_stage("data_gen", "--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "run"),
                     "data_gen.backend=dataset", f"data_gen.prompts={mt_bench}", "data_gen.heldout_percent=0", check=False)
    assert proc.returncode == 1 and "holds no assistant answers" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "run/conversations").exists()
    with pytest.raises(ValueError, match="data_gen.n=1"):
        generate.main(config(tmp_path, mt_bench, "data_gen.n=2"))


def test_online_training_runs_on_a_dataset_run_dir(tmp_path):
    flags = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "run"), "data_gen.backend=dataset",
             "data_gen.max_turns=0", "train.source=online", "train.epochs=1", "train.wandb_mode=disabled"]
    run_stage("data_gen", *flags)
    run_stage("train", *flags)
    metrics = [json.loads(x) for x in (tmp_path / "run/train/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss"] > 0 for m in metrics)  # 12 samples, batch 4
    assert (tmp_path / "run/drafter/model.safetensors").is_file()
