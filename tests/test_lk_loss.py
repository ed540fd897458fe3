"""train.loss: the LK losses (arXiv 2602.23881) beside the soft cross-entropy, held to an independent float64
definition. alpha = sum_v min(p_v * mass, q_v) over the draft vocab (mass: the target's probability of it) is
1 - TV(p, q) when nothing is pruned; lk_alpha = -log alpha is the cross-entropy at a one-hot target; each loss's
gradient (chunked and plain) equals the central finite difference of the row losses with lk_lambda's weight
held at its value (detached); kl is bit for bit the loss it always was."""

import math

import pytest
import torch

from train.draft_head_loss import TeacherRows, chunk_terms, draft_head_loss, row_losses
from train.loss_kind import KL, HeadLoss
from train.ttt_loss import step_metrics

LOSSES = [HeadLoss("kl"), HeadLoss("lk_alpha"), HeadLoss("lk_lambda", 0.9, 3.0)]


def reference(z: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, loss: HeadLoss, lam=None):
    """float64 row losses from the paper's definitions -> (loss [n], alpha [n]); lam: lk_lambda's weight per row,
    held fixed (None: from this alpha)."""
    q = torch.softmax(z.double(), -1)
    ce = -(p.double() * q.log()).sum(-1)
    alpha = torch.minimum(p.double() * mass.double()[:, None], q).sum(-1)
    if loss.kind == "kl":
        return ce, alpha
    if loss.kind == "lk_alpha":
        return -alpha.log(), alpha
    lam = loss.kl_scale * torch.exp(-loss.kl_decay * alpha) if lam is None else lam
    return lam * ce + (1 - lam) * (1 - alpha), alpha


def test_alpha_is_one_minus_total_variation_and_counts_only_the_draft_vocabs_own_mass():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.3, 0.1, 0.4], [0.7, 0.1, 0.1, 0.1]])
    one = torch.ones(2)
    for loss in LOSSES:
        _, alpha = row_losses(q.log(), q, p, one, loss)
        tv = 0.5 * (p - q).abs().sum(-1)
        torch.testing.assert_close(alpha, 1 - tv)
        torch.testing.assert_close(alpha, torch.tensor([0.2 + 0.3 + 0.1, 0.25 + 0.1 + 0.1 + 0.1]))
    # a pruned draft vocab holding 60% / 100% of the target's probability: p renormalised over it is [0.5, 0.3,
    # 0.2, 0]; the target's own probabilities there are 0.6 times that; the 40% outside is never accepted
    _, alpha = row_losses(q.log(), q, p, torch.tensor([0.6, 1.0]), KL)
    torch.testing.assert_close(alpha, torch.tensor([0.2 + 0.18 + 0.1, 0.55]))


def test_lk_alpha_is_the_cross_entropy_at_a_one_hot_target():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(5, 11, generator=g) * 2, -1)
    onehot = torch.nn.functional.one_hot(torch.tensor([3, 0, 10, 7, 7]), 11).float()
    lk, _ = row_losses(logp, logp.exp(), onehot, torch.ones(5), HeadLoss("lk_alpha"))
    ce, _ = row_losses(logp, logp.exp(), onehot, torch.ones(5), KL)
    torch.testing.assert_close(lk, ce)


def case(seed: int, n: int = 6, vd: int = 9):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vd, generator=g) * 1.5
    p = torch.softmax(torch.randn(n + 2, vd, generator=g) * 2, -1)  # teacher rows, more than the chunk reads
    rows = torch.randperm(n + 2, generator=g)[:n]
    mass = torch.rand(n + 2, generator=g) * 0.5 + 0.5  # pruned: 50-100% of the target's probability inside
    scale = torch.rand(n, generator=g) + 0.5
    return z, p, rows, mass, scale


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x.kind)
def test_chunk_terms_gradient_is_the_central_difference_of_the_row_losses(loss):
    z, p, rows, mass, scale = case(1)
    top = p.argmax(-1)
    loss_rows, _, alpha, g = chunk_terms(z, p, top, rows, scale, mass, loss)
    want_rows, want_alpha = reference(z, p[rows], mass[rows], loss)
    torch.testing.assert_close(loss_rows.double(), want_rows, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alpha.double(), want_alpha, rtol=1e-5, atol=1e-6)
    lam = loss.kl_scale * torch.exp(-loss.kl_decay * want_alpha)  # detached: held where it is
    zd, eps, fd = z.double(), 1e-6, torch.zeros_like(z, dtype=torch.float64)
    for i in range(z.shape[0]):
        for j in range(z.shape[1]):
            bump = torch.zeros_like(zd)
            bump[i, j] = eps
            hi, _ = reference(zd + bump, p[rows], mass[rows], loss, lam)
            lo, _ = reference(zd - bump, p[rows], mass[rows], loss, lam)
            fd[i, j] = ((hi - lo) * scale.double()).sum() / (2 * eps)
    torch.testing.assert_close(g.double(), fd, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x.kind)
def test_chunked_head_loss_equals_plain_autograd_for_each_loss(loss):
    """Through draft_head_loss: values, per-step sums, alpha sums and both gradients, a pruned vocab's mass
    included. The plain path is autograd of `row_losses`: a lk_lambda weight that were not detached there would
    add d lam / d alpha terms the chunked gradient does not have."""
    g = torch.Generator().manual_seed(3)
    h, vd = 16, 40
    weight = torch.randn(vd, h, generator=g, requires_grad=True)
    teacher = TeacherRows(torch.softmax(2 * torch.randn(50, vd, generator=g), -1), torch.randint(0, vd, (50,),
                          generator=g), torch.rand(50, generator=g) * 0.6 + 0.4)
    xs = [torch.randn(n, h, generator=g, requires_grad=True) for n in (17, 0, 9)]
    rows = [torch.randint(0, 50, (x.shape[0],), generator=g) for x in xs]
    scales = torch.tensor([1.0, 0.8, 0.64]) / torch.tensor([17.0, 1.0, 9.0])
    out = {}
    for chunk in (0, 5):
        total, sums, correct, alpha = draft_head_loss(xs, weight, teacher, rows, scales, chunk, loss)
        grads = torch.autograd.grad(2.5 * total, [weight, xs[0], xs[2]])
        out[chunk] = (total.detach(), sums, correct.float(), alpha, *grads)
    for a, b in zip(out[0], out[5], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    assert 0 < out[0][3][0] < 17 and out[0][3][1] == 0


def test_kl_is_the_loss_it_always_was_bit_for_bit():
    """train.loss=kl: the chunk's loss and gradient and the plain path's sum as written before the LK losses."""
    z, p, rows, mass, scale = case(2, n=7, vd=33)
    loss_rows, _, _, g = chunk_terms(z, p, p.argmax(-1), rows, scale, mass, KL)
    pc, logp = p[rows].float(), torch.log_softmax(z.float(), -1)
    assert torch.equal(loss_rows, -(pc * logp).sum(-1))
    assert torch.equal(g, (logp.exp() * pc.sum(-1, keepdim=True) - pc) * scale[:, None])
    total, *_ = draft_head_loss([z[:, :4].contiguous()], torch.eye(33, 4), TeacherRows(p, p.argmax(-1), mass),
                                [rows], torch.ones(1), 0)
    logp = torch.log_softmax(z[:, :4] @ torch.eye(33, 4).T, -1)
    assert torch.equal(total, -(p[rows] * logp).sum())


def test_step_metrics_report_alpha_per_step_and_the_tau_it_implies():
    sums = {"loss_sum": torch.tensor([4.0, 6.0, 3.0]), "correct": torch.tensor([8.0, 5.0, 2.0]),
            "alpha_sum": torch.tensor([9.0, 6.0, 2.0]), "count": torch.tensor([10.0, 10.0, 4.0])}
    row = step_metrics(sums, 0.8)
    assert [row[f"alpha_{k}"] for k in range(3)] == pytest.approx([0.9, 0.6, 0.5])
    assert row["tau_alpha"] == pytest.approx(1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.5)
    assert row["acc_0"] == pytest.approx(0.8) and row["loss"] == pytest.approx(0.4 + 0.8 * 0.6 + 0.64 * 0.75)
    assert not math.isnan(row["tau_alpha"])


def test_training_alpha_counts_the_mass_outside_a_pruned_draft_vocab():
    """teacher_targets' mass, from the precomputed full-vocab logsumexp: the target's probability of the draft
    vocab, so training's alpha never counts what a pruned drafter cannot propose."""
    from train.ttt_loss import teacher_argmax_lse, teacher_targets

    g = torch.Generator().manual_seed(5)
    final, lm_head = torch.randn(2, 10, 8, generator=g), torch.randn(40, 8, generator=g)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.randperm(40, generator=g)[:15]] = True
    mask = torch.ones(2, 10, dtype=torch.uint8)
    argmax, lse = teacher_argmax_lse(final.flatten(0, 1), lm_head)
    teacher = teacher_targets(final, mask, lm_head[t2d], t2d, argmax.view(2, 10), None, lse.view(2, 10))
    full = torch.softmax(final @ lm_head.T, -1)
    need = torch.zeros(2, 10, dtype=torch.bool)
    need[:, :-1] = True
    torch.testing.assert_close(teacher.mass[need], full[..., t2d].sum(-1)[need])
    assert (teacher.mass[need] < 0.9).all()  # the case means something: a third of the vocab, far from all of it
    torch.testing.assert_close(teacher.p[need].sum(-1), torch.ones(18))  # the cross-entropy's p: renormalised
