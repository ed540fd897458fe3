"""The decode engine: batched generation == one-by-one, and speculative == greedy token for token."""

import pytest
import torch

from core.drafters.drafter import DrafterConfig, Eagle3Drafter
from core.engine.decode import DecodeRun, Sampling, bf16_copy, generate
from core.engine.speculative import Drafting, draft_confidence, speculative_generate
from core.target.chat import prompt_ids
from core.target.model import end_of_turn_ids, load_target
from eval.report import common_prefix, summarize, write_report

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def untrained_drafter(model, aux_layers) -> Eagle3Drafter:
    c = model.config
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, target_hidden_size=c.hidden_size,
        aux_layers=aux_layers))
    d.embed_tokens.weight.data.copy_(model.model.embed_tokens.weight)
    return d.eval()


@pytest.fixture(scope="module", params=["tiny", "smol"])
def target(request, tmp_path_factory):
    from core.run.config import load_config
    from tests.conftest import ROOT

    name = {"tiny": "tiny-random-llama", "smol": "smollm2-135m-instruct"}[request.param]
    cfg = load_config(ROOT / f"configs/{name}.yaml")
    model, tok = load_target(cfg)
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return model, tok, prompts, end_of_turn_ids(tok, model.generation_config)


def test_batched_generation_equals_single(target):
    model, _, prompts, stop = target
    batched = generate(model, prompts, 12, stop)
    for p, b in zip(prompts, batched, strict=True):
        assert generate(model, [p], 12, stop)[0].tokens == b.tokens


def test_bf16_prefill_continues_the_fp32_cache_correctly():
    """Prefill under bf16 autocast, decode in fp32 or on a bf16 copy of the weights (data_gen's bf16 decode)
    from the copied cache: every token SmolLM2 picks is fp32 greedy's or a near-tie with it (bf16 rounding
    flips ties: 'waves' 11.36 vs 'ocean' 11.23), where a wrong cache hand-off would pick tokens far below."""
    from core.run.config import load_config
    from tests.conftest import ROOT

    model, tok = load_target(load_config(ROOT / "configs/smollm2-135m-instruct.yaml"))
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    stop = end_of_turn_ids(tok, model.generation_config)
    fp32 = generate(model, prompts, 12, stop)
    bf16 = generate(model, prompts, 12, stop, run=DecodeRun(bf16_prefill=True))  # fp32 steps: mostly fp32 greedy's very tokens
    agree = [next((i for i, (a, b) in enumerate(zip(x.tokens, y.tokens, strict=False)) if a != b), len(x.tokens))
             for x, y in zip(fp32, bf16, strict=True)]
    assert sum(agree) >= 0.8 * sum(len(x.tokens) for x in fp32) and min(agree) >= 4, agree
    for decoder in (None, bf16_copy(model)):
        for p, g in zip(prompts, generate(model, prompts, 12, stop, run=DecodeRun(bf16_prefill=True, decode_model=decoder)),
                        strict=True):
            with torch.no_grad():  # fp32 logits at every generated position, teacher-forced
                logits = model(torch.tensor([p + g.tokens])).logits[0, len(p) - 1:-1]
            gap = logits.max(-1).values - logits.gather(-1, torch.tensor(g.tokens)[:, None])[:, 0]
            assert len(g.tokens) >= 8 and float(gap.max()) < 0.5, (decoder is None, gap.tolist())
    with pytest.raises(ValueError, match="decode_model needs bf16_prefill"):
        generate(model, prompts, 4, stop, run=DecodeRun(decode_model=bf16_copy(model)))


def test_speculative_equals_greedy_with_untrained_drafter(target):
    model, _, prompts, stop = target
    n = model.config.num_hidden_layers
    d = untrained_drafter(model, [1, n // 2, n - 1])
    for p in prompts:  # 12 tokens: ~12 rounds, each rejecting drafts and moving both caches back
        greedy = generate(model, [p], 12, stop)[0]
        spec = speculative_generate(model, d, p, 12, stop, Drafting(3))
        assert spec.tokens == greedy.tokens and spec.finish_reason == greedy.finish_reason
        assert 1 + sum(spec.accept_lengths) == len(spec.tokens) and all(1 <= a <= 4 for a in spec.accept_lengths)


def scripted(drafter, greedy: list[int], plan: list[int], k: int, vocab: int):
    """Make the drafter propose the target's own tokens except at planned slots: round r gets its
    draft plan[r] wrong (plan[r] == k: all right), so it must accept exactly plan[r] drafts."""
    calls = iter(range(10_000))

    def draft(_draft_index):
        r, j = divmod(next(calls), k)
        if r >= len(plan):  # rounds past the plan (a bug) draft a fixed token
            return torch.tensor(0)
        start = 1 + sum(plan[:r]) + r  # tokens out before round r: the first plus plan[i] + 1 per round
        right = greedy[start + j]
        return torch.tensor(right if j != plan[r] else (right + 1) % vocab)

    drafter.draft_to_target = draft


def test_scripted_partial_accepts_give_exact_lengths_and_per_position_acceptance(target):
    model, _, prompts, _ = target
    plan, k = [2, 0, 3, 1], 3
    n_new = 1 + sum(plan) + len(plan)
    greedy = generate(model, [prompts[1]], n_new + 8, [])[0].tokens
    d = untrained_drafter(model, [1, 2, 3])
    scripted(d, greedy, plan, k, model.config.vocab_size)
    spec = speculative_generate(model, d, prompts[1], n_new, [], Drafting(k))
    assert spec.tokens == greedy[:n_new] and spec.accept_lengths == [3, 1, 4, 2]
    assert spec.drafted == [k] * (len(plan) - 1) + [1]  # the last round's budget: 2 tokens, so 1 draft
    r = summarize([{"id": "p", "tokens": len(spec.tokens), "accept_lengths": spec.accept_lengths, "match": True,
                    "drafted": spec.drafted, "time_baseline_s": 1.0, "time_spec_s": 1.0, "baseline_tokens": n_new}], k)
    assert r["per_position_acceptance"] == [3 / 4, 2 / 4, 1 / 4]  # draft i accepted in rounds with > i+1 tokens
    assert r["accept_length_histogram"] == [1, 1, 1, 1] and r["acceptance_length"] == 10 / 4


def test_draft_confidence_is_llamacpps_top10_probability():
    """llama.cpp's draft sampler is top-k 10 then a softmax over those 10: one logit of 2 beside 9 of 0 is
    p = e²/(e²+9) = 0.45 there, whatever the long tail of the vocab holds (full softmax: 0.0007 here)."""
    logits = torch.zeros(10_000)
    logits[7] = 2.0
    e2 = float(torch.tensor(2.0).exp())
    assert draft_confidence(logits) == pytest.approx(e2 / (e2 + 9), rel=1e-6)
    assert float(torch.softmax(logits, -1)[7]) < 0.001
    logits[:20] = torch.arange(20.0)  # the 10 largest are 10..19: the top one's share of those
    top = torch.arange(10.0, 20.0)
    assert draft_confidence(logits) == pytest.approx(float(torch.softmax(top, -1)[-1]), rel=1e-6)


def test_p_min_stops_each_chain_at_the_first_unsure_draft(target, monkeypatch, tmp_path):
    """Scripted confidences: with p_min 0.5 and K=3 a chain stops before the first draft under 0.5, a round
    that stops before its first draft is a plain target step (drafted 0), and the output stays greedy's.
    summarize leaves those plain steps out of τ, as llama.cpp's counters do."""
    import core.engine.speculative

    model, _, prompts, _ = target
    k, drafted = 3, [2, 0, 3, 1, 0, 3]
    n_new = 1 + sum(d + 1 for d in drafted)
    greedy = generate(model, [prompts[0]], n_new + 8, [])[0].tokens
    confidences = iter([c for d in drafted for c in [0.9] * d + ([0.2] if d < k else [])])
    monkeypatch.setattr(core.engine.speculative, "draft_confidence", lambda _logits: next(confidences))
    d = untrained_drafter(model, [1, 2, 3])
    right = iter([greedy[1 + sum(x + 1 for x in drafted[:r]) + j] for r, x in enumerate(drafted) for j in range(x)])
    d.draft_to_target = lambda _i: torch.tensor(next(right))  # every draft the target's own token
    spec = speculative_generate(model, d, prompts[0], n_new, [], Drafting(k, p_min=0.5))
    assert spec.tokens == greedy[:n_new]
    assert spec.drafted == drafted and spec.accept_lengths == [x + 1 for x in drafted]
    assert spec.drafting_rounds() == [3, 4, 2, 4]  # the rounds τ counts
    r = summarize([{"id": "p", "tokens": n_new, "accept_lengths": spec.accept_lengths, "drafted": spec.drafted,
                    "match": True, "time_baseline_s": 1.0, "time_spec_s": 1.0, "baseline_tokens": n_new}], k,
                  p_min=0.5)
    assert r["acceptance_length"] == (3 + 4 + 2 + 4) / 4 and r["drafting_share"] == 4 / 6
    assert r["per_position_acceptance"] == [4 / 4, 3 / 4, 2 / 4]
    write_report(tmp_path, {**r, "target": "t", "device": "cpu", "drafter": "d", "prompts": "p", "engine": "hf"}, [])
    assert "stopped at a draft below p 0.5 (τ counts the verifications that drafted; our engine drafted in 67% of its)" \
        in (tmp_path / "report.md").read_text()
    none = summarize([{"id": "p", "tokens": 3, "accept_lengths": [1, 1], "drafted": [0, 0], "match": True,
                       "time_baseline_s": 1.0, "time_spec_s": 1.0, "baseline_tokens": 3}], k, p_min=0.99)
    assert none["acceptance_length"] == 1.0 and none["drafting_share"] == 0  # plain steps only: τ 1, not 0
    with pytest.raises(ValueError, match="greedy chain"):
        speculative_generate(model, d, prompts[0], 4, [], Drafting(k, p_min=0.5), Sampling(1.0))


def test_accepted_stop_id_ends_generation_and_no_later_round_counts(target):
    """A stop id accepted mid-chain ends the answer in that round: no further verification runs
    (before the fix, the loop kept verifying past it and τ counted those rounds)."""
    model, _, prompts, _ = target
    k = 4
    greedy = generate(model, [prompts[2]], 24, [])[0].tokens
    i = next(i for i in (2, 3) if greedy[i] not in greedy[:i])  # its first occurrence, mid-chain of round 1
    stop = [greedy[i]]
    d = untrained_drafter(model, [1, 2, 3])
    scripted(d, greedy, [k] * 4, k, model.config.vocab_size)  # every draft right: round 1 proposes greedy[1:5]
    spec = speculative_generate(model, d, prompts[2], 24, stop, Drafting(k))
    assert spec.tokens == generate(model, [prompts[2]], 24, stop)[0].tokens == greedy[: i + 1]
    assert spec.finish_reason == "stop" and spec.accept_lengths == [i]


def test_generation_stops_at_end_of_turn(target):
    model, tok, prompts, stop = target
    out = generate(model, prompts, 64, stop)
    for g in out:
        if g.finish_reason == "stop":
            assert g.tokens[-1] in stop and not set(g.tokens[:-1]) & set(stop)
        else:
            assert len(g.tokens) == 64


def test_a_report_says_where_mismatched_outputs_part_and_why(tmp_path):
    """Greedy spec outputs that leave the baseline: the report counts them, says after how many tokens,
    and tells bf16 rounding (the verify pass and the one-token step reduce differently) from a float32 bug."""
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [6]) == 0
    rows = [{"id": i, "tokens": 4, "accept_lengths": [2, 2], "drafted": [3, 3], "match": m, "agree": a, "time_baseline_s": 1.0,
             "time_spec_s": 1.0, "baseline_tokens": 4} for i, (m, a) in enumerate([(True, 4), (False, 37), (False, 5)])]
    r = summarize(rows, 3)
    assert r["outputs_match_baseline"] is False and r["mismatched_prompts"] == [1, 2]
    assert r["mismatches_agree_for"] == [5, 37]
    for dtype, why in (("bf16", "bf16 target"), ("fp32", "a bug until shown otherwise")):
        report = {**r, "target": "t", "device": "cpu", "drafter": "d", "prompts": "p", "engine": "hf",
                  "config": {"target": {"dtype": dtype}}}
        write_report(tmp_path / dtype, report, rows)
        md = (tmp_path / dtype / "report.md").read_text()
        assert "**no**: 1/3 prompts identical; the others agree for their first 5, 37 tokens" in md and why in md
