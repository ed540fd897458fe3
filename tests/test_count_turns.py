"""data_gen/count_turns.py counts the requests data_gen would send, and cuts where data_gen would.

Run: .venv/bin/python -m pytest tests/test_count_turns.py -q
"""

from core.run.config import load_config
from core.target.chat import prompt_ids
from core.target.model import load_tokenizer
from core.target.prompts import Prompt
from data_gen import count_turns
from tests.conftest import ROOT


def test_request_lengths_are_data_gens_requests_with_empty_answers():
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", ["data_gen.max_turns=0"])
    tok = load_tokenizer(cfg)
    system, a, b, c = ({"role": r, "content": t} for r, t in
                       [("system", "be brief"), ("user", "a"), ("user", "b b b b"), ("user", "c")])
    prompt = Prompt("x", [system, a, {"role": "assistant", "content": "an original answer"}, b, c])
    empty = {"role": "assistant", "content": ""}
    want = [len(prompt_ids(tok, m)) for m in ([system, a], [system, a, empty, b], [system, a, empty, b, empty, c])]
    assert count_turns.request_lengths(prompt, tok, cfg.data_gen, stop_above=10_000) == want
    assert count_turns.request_lengths(prompt, tok, cfg.data_gen, stop_above=want[0]) == want[:2]  # stops after the first longer one


def test_turns_kept_cuts_at_the_prompt_limit_and_the_first_request_past_the_context():
    lengths = [10, 50, 90]  # each later request carries one answer more (k answers before turn k)
    assert count_turns.turns_kept(lengths, 10, 1000, 0) == 3
    assert count_turns.turns_kept(lengths, 9, 1000, 0) == 0
    assert count_turns.turns_kept(lengths, 10, 70, 20) == 2  # 50 + 1 * 20 fits, 90 + 2 * 20 does not
    assert count_turns.turns_kept(lengths, 10, 69, 20) == 1
    assert count_turns.turns_kept([10, 10, 200, 10], 10, 100, 0) == 2  # data_gen ends there, no later turn
