"""data_gen's `hf` backend schedule (data_gen/batch_pool.py) with a scripted backend in place of the target
(a test double): full calls across parts, the same rows as answering each conversation alone, parts
committed whole and in order through a stop and a rerun."""

import hashlib
import json
import math
import os
import signal

import pyarrow.parquet as pq
import pytest

from core.run.config import load_config
from core.run.errors import UserError
from core.storage.conversations import part_files
from core.target.model import load_target
from core.target.prompts import load_prompts
from data_gen import generate
from data_gen.chat_tokenize import thinking_style
from data_gen.conversation import regenerations, to_rows
from data_gen.openai_client import Reply
from tests.conftest import ROOT

TURNS = [1, 6, 2, 5, 3, 4, 6, 1, 5, 2, 4, 3]  # user turns of each conversation; parts of 4, batch 4
BATCH = 4
FIELDS = ("id", "messages", "input_ids", "loss_mask", "finish_reason")


class Stopped(Exception):
    """What the double raises in place of a kill."""


def scripted_reply(ids: list[int]) -> Reply:
    """A reply that depends only on the prompt's ids: an answer given to the wrong request shows."""
    h = hashlib.sha256(repr(ids).encode()).hexdigest()[:8]
    return Reply(f"Answer {h} to {len(ids)} tokens.", "", "length" if int(h, 16) % 3 == 0 else "stop", 8)


class ScriptedBackend:
    """Test double for data_gen.hf_backend.HFBackend: scripted replies, every call's size recorded;
    call number `stop_at` (0-based) raises Stopped instead of answering."""

    def __init__(self, stop_at: int | None = None):
        self.calls: list[int] = []
        self.stop_at = stop_at

    def answer(self, prompts: list[list[int]]) -> list[Reply]:
        assert 0 < len(prompts) <= BATCH, len(prompts)
        if len(self.calls) == self.stop_at:
            raise Stopped
        self.calls.append(len(prompts))
        return [scripted_reply(ids) for ids in prompts]


@pytest.fixture
def cfg(tmp_path):
    with (tmp_path / "p.jsonl").open("w") as f:
        for i, turns in enumerate(TURNS):  # first turns of one token length: data_gen keeps the file order
            conv = [m for t in range(turns) for m in ({"from": "human", "value": f"Question {t + 1} of conv {i:02d}?"},
                                                       {"from": "gpt", "value": "an old answer"})]
            f.write(json.dumps({"id": f"c{i:02d}", "conversations": conv}) + "\n")
    return load_config(ROOT / "configs/tiny-random-llama.yaml", [
        f"run_dir={tmp_path / 'run'}", f"data_gen.prompts={tmp_path / 'p.jsonl'}", "data_gen.heldout_percent=0",
        f"data_gen.num_samples={len(TURNS)}", "data_gen.max_turns=0", f"data_gen.batch_size={BATCH}",
        "data_gen.part_samples=4"])


def run(cfg, monkeypatch, backend: ScriptedBackend) -> None:
    monkeypatch.setattr(generate, "HFBackend", lambda *args: backend)
    generate.main(cfg)


def written(cfg) -> list[list[dict]]:
    """Each committed part file's rows, in order."""
    return [[{k: r[k] for k in FIELDS} for r in pq.read_table(f).to_pylist()]
            for f in part_files(cfg.run_path / "conversations")]


def answered_alone(cfg):
    """Every conversation answered by itself, turn after turn, with the double's replies -> (their rows in
    parts of 4, in the file's order: what the turn-synchronous loop commits; their assistant turns)."""
    model, tok = load_target(cfg)
    dg, thinking = cfg.data_gen, thinking_style(tok, cfg.data_gen.reasoning, cfg.data_gen.chat_template_kwargs)
    eot = generate.end_of_turn_strings(cfg, tok, model.generation_config)
    convs = [c for p in load_prompts(dg.prompts, "train", 0) for c in regenerations(p, 0, 1, None)]
    for c in convs:
        while (ids := generate.request_ids(c, tok, dg)) is not None:
            c.add_reply(scripted_reply(ids), thinking)
    rows = [[{k: r[k] for k in FIELDS} for r in to_rows(c, tok, eot, dg.reasoning, {}, "m", "h")] for c in convs]
    return [sum(rows[i:i + 4], []) for i in range(0, len(rows), 4)], [c.answered for c in convs]


def test_pooled_calls_write_what_answering_each_conversation_alone_writes(cfg, monkeypatch):
    backend = ScriptedBackend()
    run(cfg, monkeypatch, backend)
    parts, answered = answered_alone(cfg)
    assert answered == TURNS and {r["finish_reason"] for p in parts for r in p} == {"stop", "length"}
    assert written(cfg) == parts  # the same rows, parts and order as the turn-synchronous loop
    assert sum(backend.calls) == sum(TURNS)  # each turn answered once


def test_every_call_is_full_until_the_last_conversations_run_out(cfg, monkeypatch):
    backend = ScriptedBackend()
    run(cfg, monkeypatch, backend)
    total = sum(TURNS)  # 42 answers: 11 calls at the least
    turn_synchronous = sum(max(TURNS[i:i + 4]) for i in range(0, len(TURNS), 4))  # a call per turn of each part
    assert turn_synchronous == 17 and math.ceil(total / BATCH) == 11
    # 12 calls: full ones, then the last part's longest conversations once nothing is left to admit
    assert backend.calls == [BATCH] * 9 + [3, 2, 1]


# Earliest parts first: part 0 is done after call 6 (its 6-turn conversation is in every call), part 1 after 9.
@pytest.mark.parametrize(("stop_at", "whole_parts"), [(3, 0), (7, 1), (10, 2)])
def test_a_stopped_run_leaves_whole_parts_in_order_and_a_rerun_finishes_the_rest(cfg, monkeypatch, stop_at,
                                                                                  whole_parts):
    with pytest.raises(Stopped):
        run(cfg, monkeypatch, ScriptedBackend(stop_at))
    parts, answered = answered_alone(cfg)
    assert written(cfg) == parts[:whole_parts]  # committed as soon as done, whole, earliest first
    rerun = ScriptedBackend()
    run(cfg, monkeypatch, rerun)
    assert written(cfg) == parts  # nothing lost, nothing twice
    assert sum(rerun.calls) == sum(answered[4 * whole_parts:])  # only the uncommitted parts are redone


class TermBackend(ScriptedBackend):
    """The double, receiving SIGTERM (as from `timeout`) during call number `term_at`, which still completes."""

    def __init__(self, term_at: int):
        super().__init__()
        self.term_at = term_at

    def answer(self, prompts: list[list[int]]) -> list[Reply]:
        if len(self.calls) == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().answer(prompts)


@pytest.mark.parametrize("term_at", [2, 5])
def test_sigterm_commits_every_finished_conversation_and_a_rerun_does_only_the_rest(cfg, monkeypatch, term_at):
    """A kill at call 3 leaves no part (above); SIGTERM at call 2 stops after it and keeps the conversations
    that call finished, whole: nothing lost, nothing twice, and the rerun answers only the others' turns."""
    backend = TermBackend(term_at)
    with pytest.raises(UserError, match="stopped by SIGTERM"):
        run(cfg, monkeypatch, backend)
    assert len(backend.calls) == term_at + 1  # stopped after the call in flight
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the stage's handler is gone
    parts, answered = answered_alone(cfg)
    alone = {r["id"]: r for p in parts for r in p}
    kept = [r for p in written(cfg) for r in p]
    assert kept and all(r == alone[r["id"]] for r in kept)  # whole conversations, as answered alone
    assert len({r["id"] for r in kept}) == len(kept)
    assert len(kept) > 4 * sum(1 for i in range(len(parts)) if all(r["id"] in {k["id"] for k in kept}
                                                                     for r in parts[i]))  # more than whole parts
    summary = json.loads((cfg.run_path / "conversations/summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["conversations_total"] == len(kept)
    rerun = ScriptedBackend()
    run(cfg, monkeypatch, rerun)
    rows = [r for p in written(cfg) for r in p]
    assert sorted(rows, key=lambda r: r["id"]) == sorted(alone.values(), key=lambda r: r["id"])
    assert sum(rerun.calls) == sum(n for n, p in zip(answered, [r for p in parts for r in p], strict=True)
                                   if p["id"] not in {k["id"] for k in kept})


def test_out_of_memory_names_the_batch_and_the_knobs(monkeypatch):
    """A batch that does not fit the device ends data_gen with one line naming data_gen.batch_size, not a
    CUDA traceback (the H200 at batch 512 x 1,792-token contexts). The OOM itself is raised by a stand-in
    for core.engine.decode.generate: no CPU run can be made to reach it."""
    import torch

    from data_gen import hf_backend

    def out_of_memory(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.59 GiB")

    monkeypatch.setattr(hf_backend, "generate", out_of_memory)
    model = type("Model", (), {"device": torch.device("cpu")})()
    backend = hf_backend.HFBackend(model, None, [0], 256, 0.0, 0)
    with pytest.raises(UserError, match=r"answering 2 prompts of up to 5 tokens \(\+ 256 new\): lower "
                                        r"data_gen.batch_size or data_gen.max_context_tokens"):
        backend.answer([[1, 2, 3], [1, 2, 3, 4, 5]])
