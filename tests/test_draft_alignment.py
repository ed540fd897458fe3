"""Training and decoding align the drafter the same way, proven through the production functions
(`ttt_loss`, `speculative_generate`, `extract_batch`, `build_drafter`) on the real SmolLM2 target:
1. TTT's step-k output (normed, what lm_head reads) at position t equals the k-th chained draft from t
   at decode time;
2. a drafter overfit on one sequence drafts that sequence back at decode time (τ ≈ K+1).
Either fails on an off-by-one in tokens, RoPE positions or the draft cache's rollback."""

import pytest
import torch

from core.engine.decode import generate
from core.engine.speculative import Drafting, speculative_generate
from core.run.config import load_config
from core.target.chat import prompt_ids
from core.target.hidden_capture import extract_batch
from core.target.model import load_target, load_target_embeddings
from tests.conftest import ROOT
from train.draft_vocab import build_draft_vocab
from train.loop import build_drafter
from train.ttt_loss import Rows, Teacher, TTTObjective, teacher_argmax_lse, teacher_targets, ttt_loss

K = 3
ANSWER_TOKENS = 30  # 25 distinct tokens; the overfit takes 120 steps (40 tokens: 171)


@pytest.fixture(scope="module")
def seq():
    """The target's own greedy answer to one prompt, and the target's aux / final rows over it."""
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml")
    model, tok = load_target(cfg)
    prompt = prompt_ids(tok, [{"role": "user", "content": "Name three rivers in Europe and say where they flow."}])
    answer = generate(model, [prompt], ANSWER_TOKENS, stop_ids=[])[0].tokens
    n = model.config.num_hidden_layers
    ids, aux, final = extract_batch(model, [prompt + answer], [2, n // 2, n - 3])[0]
    assert len(set(answer)) > 20, "the answer must not be a repetition, or a shifted token would go unseen"
    return cfg, model, prompt, answer, ids[None], aux[None].float(), final[None].float()


def drafter_for(seq, seed: int, *flags: str):
    """A drafter for the sequence; flags: train config overrides (the EAGLE-3.1 variants)."""
    cfg, _, _, _, ids, aux, _ = seq
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", list(flags)) if flags else cfg
    counts = torch.bincount(ids[0], minlength=49152)
    draft_ids, t2d, _ = build_draft_vocab(counts, 256)  # every token of the sequence is in the draft vocab
    torch.manual_seed(seed)
    aux_scale = aux[0].pow(2).mean(0).sqrt().clamp(min=1e-3)
    return build_drafter(cfg, [2, 15, 27], draft_ids, t2d, load_target_embeddings(cfg), aux_scale), draft_ids, t2d


def capture(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every output of `module`, in call order."""
    seen = []
    module.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().reshape(-1, out.shape[-1]).clone()))
    return seen


@pytest.mark.parametrize("flags", [(), ("train.fc_norm=true", "train.norm_output=true"), ("train.draft_attention=mla",),
                                   ("train.draft_attention=mla", "train.fc_norm=true", "train.norm_output=true")],
                         ids=["eagle3", "eagle3.1", "mla", "mla-eagle3.1"])
def test_ttt_step_outputs_equal_decode_time_drafts(seq, monkeypatch, flags):
    """Training's K unrolled steps compute what decoding drafts, row for row (EAGLE-3.1's fc_norm and norm_output:
    the next step reads norm(h2) in both, or in neither; an MLA layer: TTT's keys of the earlier steps are the
    draft cache's)."""
    cfg, model, prompt, answer, ids, aux, _ = seq
    drafter, _, _ = drafter_for(seq, 1, *flags)
    assert drafter.config.norm_output == ("train.norm_output=true" in flags)
    assert (drafter.config.mla is not None) == ("train.draft_attention=mla" in flags)
    drafter.eval()
    full = torch.cat([torch.tensor(prompt), torch.tensor(answer)])
    t_len, p_len = full.numel(), len(prompt)

    outputs = capture(drafter.norm)  # TTT over the whole sequence: step k counts positions 0..T-k-3
    ones = torch.ones(1, t_len, dtype=torch.uint8)
    teacher = Teacher(torch.zeros(1, t_len, drafter.config.draft_vocab_size), torch.zeros(1, t_len, dtype=torch.long),
               torch.ones(1, t_len, dtype=torch.bool), torch.ones(1, t_len))
    with torch.no_grad():
        ttt_loss(drafter, Rows(aux, ids, ones), teacher, K, 1.0)
    assert [s.shape[0] for s in outputs] == [t_len] * K  # the unroll norms every row; the loss reads these
    steps = [s[:t_len - k - 2] for k, s in enumerate(outputs)]

    # Decode with the target's own tokens as drafts: every draft is accepted, round r starts at
    # m = P + r(K+1), and its j-th draft is the sequence's token m + 1 + j.
    calls = iter(range(10_000))

    def oracle(_draft_index):
        r, j = divmod(next(calls), K)
        return torch.tensor(full[min(p_len + r * (K + 1) + 1 + j, t_len - 1)].item())

    monkeypatch.setattr(drafter, "draft_to_target", oracle)
    outputs.clear()
    out = speculative_generate(model, drafter, prompt, len(answer), [], Drafting(K))
    assert out.tokens == answer and out.accept_lengths[:-1] == [K + 1] * (len(out.accept_lengths) - 1)
    decode = list(outputs)
    tol = {"rtol": 1e-3, "atol": 2e-3}  # aux from one batched pass vs from incremental verifications
    torch.testing.assert_close(decode.pop(0), steps[0][:p_len], **tol, msg="step 0 over the prompt")
    rounds = len(out.accept_lengths)
    for r in range(rounds):
        t = p_len + r * (K + 1) - 1  # the drafter's last position before round r drafts
        for k in range(1, out.drafted[r]):  # K drafts a round; the last one as many as its budget can emit
            if t < steps[k].shape[0]:
                torch.testing.assert_close(decode.pop(0)[0], steps[k][t], **tol, msg=f"round {r}, step {k}")
            else:
                decode.pop(0)
        if r + 1 < rounds:  # re-reading the accepted tokens: step 0 at positions t+1..t+K+1
            lo = t + 1
            hi = min(lo + K + 1, steps[0].shape[0])
            torch.testing.assert_close(decode.pop(0)[: hi - lo], steps[0][lo:hi], **tol, msg=f"round {r}, step 0")
    assert not decode


def test_overfit_one_sequence_then_decode_accepts_nearly_every_draft(seq):
    cfg, model, prompt, answer, ids, aux, final = seq
    drafter, draft_ids, t2d = drafter_for(seq, seed=0)
    loss_mask = torch.zeros_like(ids, dtype=torch.uint8)
    loss_mask[0, len(prompt):] = 1
    lm_head = load_target_embeddings(cfg).lm_head
    argmax, lse = teacher_argmax_lse(final, lm_head)
    teacher = teacher_targets(final, loss_mask, lm_head[draft_ids], t2d, argmax, None, lse)
    objective = TTTObjective(drafter, K, 0.8)
    opt = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(300):
        loss, m = objective(aux, ids, loss_mask, teacher)
        acc = m["correct"] / m["count"]
        if bool((acc == 1).all()):
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert bool((acc == 1).all()), f"no overfit in 300 steps: acc_k {acc.tolist()}"
    out = speculative_generate(model, drafter.eval(), prompt, len(answer), [], Drafting(K))
    assert out.tokens == answer
    full_rounds = out.accept_lengths[:-1]  # the last round is cut to what fits in max_new_tokens
    assert sum(full_rounds) >= (K + 1) * len(full_rounds) - 1, out.accept_lengths
