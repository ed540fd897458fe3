"""Tree drafting and speculative sampling in our decode engine, on a drafter from the real pipeline
(tests/conftest.overfit_tiny): an EAGLE-2 tree at T=0 writes exactly the greedy output, and takes
paths that are not the drafter's first guess (so the cache compaction after a verification is
exercised); chain speculative sampling at T=1 draws tokens from the target's own distribution."""

import json
import math
import re
from collections import Counter

import pytest
import torch

import core.engine.speculative as speculative
from core.drafters.draft_tree import TreeSpec
from core.drafters.drafter import Eagle3Drafter
from core.engine.decode import Sampling, generate
from core.engine.speculative import Drafting, speculative_generate
from core.run.errors import UserError
from core.target.chat import eval_prompt_ids
from core.target.model import (
    end_of_turn_ids,
    load_target,
    load_target_embeddings,
    load_tokenizer,
    target_info,
)
from tests.conftest import ROOT, run_stage


@pytest.fixture(scope="module")
def engine(overfit_tiny):
    cfg, run_dir, _, prompts = overfit_tiny
    model, tok = load_target(cfg)
    info = target_info(cfg)
    drafter = Eagle3Drafter.from_pretrained(run_dir / "drafter", load_target_embeddings(cfg).embed, info.model_type,
                                            info.num_layers).eval()
    trained = [ids for _, ids in eval_prompt_ids(cfg, load_tokenizer(cfg), str(prompts))]
    cfg.eval.max_prompts = 12
    heldout = [ids for _, ids in eval_prompt_ids(cfg, tok, str(ROOT / "tests/data/mt_bench_3.jsonl"))]
    cfg.eval.prompts = "heldout"
    heldout += [ids for _, ids in eval_prompt_ids(cfg, tok, None)]
    return model, drafter, trained, heldout, end_of_turn_ids(tok, model.generation_config)


@pytest.fixture(scope="module")
def greedy_outputs(engine):
    """The target's greedy answer (20 tokens) to every prompt of `engine`, computed once for all the tree
    shapes below: plain greedy decoding does not depend on the tree, and it is deterministic."""
    model, _, trained, heldout, stop = engine
    return [generate(model, [p], 20, stop)[0] for p in trained + heldout]


def test_a_tree_cannot_promise_more_nodes_than_it_grows():
    assert TreeSpec(3, 2, 10).total == 10  # 2 + 4 + 4 nodes
    with pytest.raises(ValueError, match="at most 10 nodes"):
        TreeSpec(3, 2, 11)


@pytest.mark.parametrize("spec", [TreeSpec(3, 2, 6), TreeSpec(4, 3, 8), TreeSpec(2, 4, 4)])
def test_tree_at_t0_writes_the_greedy_output(engine, greedy_outputs, spec, monkeypatch):
    model, drafter, trained, heldout, stop = engine
    moved = []
    compact = speculative._compact
    monkeypatch.setattr(speculative, "_compact", lambda c, slots, start: (moved.append(slots != list(
        range(start, start + len(slots)))), compact(c, slots, start)))
    lengths = []
    for i, (p, greedy) in enumerate(zip(trained + heldout, greedy_outputs, strict=True)):
        out = speculative_generate(model, drafter, p, 20, stop, Drafting(3, spec))
        assert out.tokens == greedy.tokens and out.finish_reason == greedy.finish_reason
        assert 1 + sum(out.accept_lengths) == len(out.tokens) and max(out.accept_lengths) <= spec.depth + 1
        lengths += out.accept_lengths if i < len(trained) else []
    assert len(trained + heldout) >= 20 and sum(lengths) / len(lengths) > 1.5  # the tree is mostly accepted
    assert any(moved), "no verification accepted a path off the first-guess branch: compaction untested"


class TargetAsDrafter(torch.nn.Module):
    """TEST DOUBLE for the sampling test: drafts from the target's own logits times `sharpen` (so q is
    close to p but not equal: most drafts are accepted, many are not). It rebuilds the sequence from
    the (position, token) pairs speculative_generate feeds it; K/V caching is irrelevant to it."""

    def __init__(self, model, prompt: list[int], sharpen: float):
        super().__init__()
        self.model, self.first, self.sharpen, self.seq = model, prompt[0], sharpen, {}
        self.config = type("C", (), {"aux_layers": [1, 2, 3]})()

    def forward(self, hidden, tokens, positions, cache, visible=None):
        for t, pos in zip(tokens[0].tolist(), positions[0].tolist(), strict=True):
            self.seq[pos + 1] = t  # the drafter reads token t+1 at position t
        last = positions[0].tolist()
        ids = [self.first] + [self.seq[i] for i in range(1, max(last) + 2)]
        # the rows of positions last + 1: the sequence's final len(last) positions (logits_to_keep)
        logits = self.model(torch.tensor([ids]), logits_to_keep=len(last)).logits[0] * self.sharpen
        return logits[None], hidden[..., :1].expand(1, len(last), 1)

    def draft_to_target(self, ids):
        return ids


def _kolmogorov_p(d: float, n: int) -> float:
    """P(KS statistic >= d) for n samples against a continuous distribution (asymptotic)."""
    x = d * math.sqrt(n)
    return max(0.0, min(1.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))))


def _pit(logits: torch.Tensor, token: int, u: float) -> float:
    """Randomised probability integral transform of a token drawn from softmax(logits): uniform on
    [0,1] exactly when the token was drawn from that distribution."""
    p = torch.softmax(logits.double(), -1)
    # the tokens a stable descending sort puts before `token`: more likely ones, and equally likely ones
    # of a lower id (no sort of the whole vocab: the same sum in O(V))
    before = (p > p[token]) | ((p == p[token]) & (torch.arange(p.numel()) < token))
    return float(p[before].sum() + u * p[token])


@pytest.mark.parametrize("drafter_kind", ["pipeline drafter", "target as drafter (test double)"])
def test_speculative_sampling_at_t1_keeps_the_target_distribution(engine, drafter_kind):
    """150 answers of 4 tokens by chain speculative sampling (T=1, K=2): tokens 2-4 went through the
    acceptance test, the residual or the bonus draw. Each, mapped through the target's own CDF at its position
    (randomised PIT), must be uniform (Kolmogorov-Smirnov, p > 1e-3). Sampling the residual from p
    instead of max(p - q, 0), or accepting every draft, fails this (p < 1e-14; docs/TESTING.md)."""
    model, drafter, trained, _, _ = engine
    prompt, n = trained[1], 150
    if drafter_kind != "pipeline drafter":
        drafter = TargetAsDrafter(model, prompt, sharpen=1.6)
    g, rng = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    answers, accepted = [], Counter()
    with torch.inference_mode():
        for _ in range(n):
            out = speculative_generate(model, drafter, prompt, 4, [], Drafting(2), Sampling(1.0, g))
            accepted[out.accept_lengths[0]] += 1
            answers.append(out.tokens)
        # the target's logits at answer positions 2-4, in batches (every sequence has the same length)
        seqs = torch.tensor([prompt + a[:3] for a in answers])
        logits = torch.cat([model(rows, logits_to_keep=3).logits for rows in seqs.split(100)])
    pits = [_pit(logits[i, j], a[1 + j], float(torch.rand((), generator=rng))) for i, a in enumerate(answers)
            for j in range(3)]
    if drafter_kind != "pipeline drafter":  # both the rejection and the all-accepted path ran often
        assert accepted[1] > n // 12 and accepted[3] > n // 12, accepted
    pits.sort()
    d = max(max((i + 1) / len(pits) - x, x - i / len(pits)) for i, x in enumerate(pits))
    assert _kolmogorov_p(d, len(pits)) > 1e-3, (d, accepted)


def test_eval_cli_reports_tree_and_sampling_modes(overfit_tiny, tmp_path):
    """`python -m eval` with eval.draft_tree / eval.temperature: the report names the mode, counts
    acceptance per tree depth, keeps greedy outputs equal and does not compare sampled ones."""
    cfg, _, flags, prompts = overfit_tiny
    tree_out, t_out = tmp_path / "tree", tmp_path / "t07"
    run_stage("eval", *flags, "--prompts", str(prompts), "--out", str(tree_out), "eval.draft_tree=[3,2,6]")
    run_stage("eval", *flags, "--prompts", str(prompts), "--out", str(t_out), "eval.temperature=0.7")
    tree, sampled = (json.loads((d / "report.json").read_text()) for d in (tree_out, t_out))
    assert tree["draft_tree"] == [3, 2, 6] and tree["drafted_per_verification"] == 6
    assert tree["outputs_match_baseline"] is True and len(tree["per_position_acceptance"]) == 3
    assert tree["acceptance_length"] > 1.5 and "EAGLE-2 tree (depth 3, top-2, 6 drafted tokens)" in (
        tree_out / "report.md").read_text()
    assert sampled["temperature"] == 0.7 and sampled["outputs_match_baseline"] is None
    assert all(r["match"] is None for r in sampled["per_prompt"]) and sampled["acceptance_length"] > 1.0
    assert "speculative sampling at T=0.7" in (t_out / "report.md").read_text()
    proc = run_stage("eval", *flags, "--prompts", str(prompts), "--out", str(tmp_path / "bad"), "eval.draft_tree=[3,2]",
                   check=False)
    assert proc.returncode != 0 and "eval.draft_tree must be [depth, topk, total]" in proc.stderr.splitlines()[-1]
    from eval.run import main  # the other bad values through main itself: the same checks

    for bad, says in (({"temperature": -1.0}, "eval.temperature = -1.0: must be >= 0"),
                      ({"max_new_tokens": 0}, "eval.max_new_tokens = 0: must be >= 1")):
        with pytest.raises(UserError, match=re.escape(says)):
            main(cfg, prompts=str(prompts), out=str(tmp_path / "bad"), **bad)
    assert not (tmp_path / "bad").exists()
