"""Sequence packing (train.kernels.pack_length) trains what the right-padded batch trains: four documents packed
into two rows give the padded batch's loss, per-step sums and gradients through train/fit.py's batch_loss
(fp32, 1e-5), no document reads another, and flex's document block mask equals the dense mask (forward:
flex has no CPU backward)."""

import pytest
import torch

from core.drafters.drafter import Eagle3Drafter
from core.run.config import RunConfig, TrainConfig, TrainKernels
from core.run.errors import UserError
from tests.test_ttt_fast_paths import TOL, drafter
from train import ttt_attention
from train.fit import Fit, TeacherHead, batch_loss
from train.packing import pack
from train.ttt_attention import BLOCK, dense_ttt_attention, flex_ttt_attention, ttt_block_mask
from train.ttt_loss import Rows, StepOptions, TTTObjective, teacher_argmax_lse, teacher_targets, ttt_loss

LENGTHS, PACK, K = [20, 15, 25, 12], 40, 4  # next-fit: rows [20 | 15 | 5 pad], [25 | 12 | 3 pad]


def padded_batch(lengths, d, seed=1):
    """A batch as train/data.py's collate and a source's complete() give it, with random hidden states,
    a loss mask on ~half the tokens, the teacher's argmax out of the draft vocab at ~40% of positions."""
    g = torch.Generator().manual_seed(seed)
    b, t, h = len(lengths), max(lengths), d.config.target_hidden_size
    valid = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).to(torch.uint8)
    final = torch.randn(b, t, h, generator=g) * valid[..., None]
    argmax, lse = teacher_argmax_lse(final, lm_head(d))
    return {"ids": [f"s{i}" for i in range(b)], "valid": valid,
            "input_ids": torch.randint(0, d.config.vocab_size, (b, t), generator=g) * valid,
            "loss_mask": (torch.rand(b, t, generator=g) < 0.5).to(torch.uint8) * valid,
            "aux": torch.randn(b, t, 3 * h, generator=g) * valid[..., None], "final": final,
            "argmax": argmax * valid, "teacher_lse": lse * valid}


def lm_head(d):
    return torch.randn(d.config.vocab_size, d.config.target_hidden_size, generator=torch.Generator().manual_seed(5))


def run_batch(batch, pack_length, loss_on_prompt=False, aux_noise=0.0, prune_rows=False):
    """train/fit.py's batch_loss on a fresh drafter -> (loss, per-step sums, gradients)."""
    d = drafter()
    tc = TrainConfig(ttt_steps=K, max_len=PACK, loss_on_prompt=loss_on_prompt, aux_noise=aux_noise,
                     kernels=TrainKernels(pack_length=pack_length))
    source = type("Source", (), {"complete": staticmethod(lambda b: b), "where": staticmethod(str)})
    head = TeacherHead(lm_head(d)[d.t2d], d.t2d, torch.rand(3 * d.config.target_hidden_size) + 0.5)
    objective = TTTObjective(d, K, 0.8, StepOptions(prune_rows=prune_rows))
    f = Fit(cfg=RunConfig(train=tc), accelerator=None, objective=objective, opt=None, source=source, ds=None,
            probe=None, head=head, train_dir=None, step_batches=1, accum=1, export=None)
    loss, sums = batch_loss(f, batch, epoch=1, index=3, step=0)
    loss.backward()
    return loss.detach(), sums, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}


def assert_same(a, b):
    (l0, s0, g0), (l1, s1, g1) = a, b
    torch.testing.assert_close(l1, l0, **TOL)
    assert s1["count"].tolist() == s0["count"].tolist() and s1["correct"].tolist() == s0["correct"].tolist()
    torch.testing.assert_close(s1["loss_sum"], s0["loss_sum"], **TOL)
    assert sorted(g0) == sorted(g1) and len(g0) >= 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **TOL, msg=name)


def test_pack_lays_documents_out_next_fit_with_their_own_ids_and_positions():
    d = drafter()
    batch = padded_batch(LENGTHS, d)
    p = pack(batch, PACK)
    assert p["input_ids"].shape == (2, PACK) and p["aux"].shape == (2, PACK, batch["aux"].shape[-1])
    runs = [(0, 0, 0, 20), (0, 20, 1, 15), (1, 0, 0, 25), (1, 25, 1, 12)]  # row, offset, doc id, length
    for i, (r, off, doc, n) in enumerate(runs):
        for key in ("input_ids", "loss_mask", "aux", "final", "argmax"):
            assert torch.equal(p[key][r, off:off + n], batch[key][i, :n]), key
        assert p["doc_ids"][r, off:off + n].eq(doc).all()
        assert torch.equal(p["positions"][r, off:off + n], torch.arange(n))
    assert p["doc_ids"][0, 35:].eq(-1).all() and p["doc_ids"][1, 37:].eq(-1).all() and p["valid"].sum() == sum(LENGTHS)
    assert p["ids"] == batch["ids"]
    with pytest.raises(UserError, match="train.kernels.pack_length = 24: set train.kernels.pack_length >= train.max_len"):
        pack(batch, 24)


@pytest.mark.parametrize("loss_on_prompt, aux_noise, prune_rows", [(False, 0.0, False), (True, 0.3, False),
                                                                    (False, 0.0, True)])
def test_packed_batch_gives_the_padded_batchs_loss_sums_and_gradients(loss_on_prompt, aux_noise, prune_rows):
    """loss_on_prompt: every next document's first token is trained on, so a row that read across a
    boundary would count; aux_noise: drawn for the padded batch, before packing; prune_rows (the packed
    run only): steps >= 1 on the counted rows of packed documents."""
    batch = padded_batch(LENGTHS, drafter())
    padded, packed = (run_batch(batch, n, loss_on_prompt, aux_noise, prune_rows=n > 0 and prune_rows)
                      for n in (0, PACK))
    assert padded[1]["count"].min() >= 5
    assert_same(padded, packed)


def test_packed_rows_run_at_each_documents_own_positions(monkeypatch):
    """RoPE is relative, so row-wide positions would train the same up to rounding (the test above cannot
    tell); each document's own positions are the padded batch's, exactly."""
    seen, qkv = [], Eagle3Drafter.qkv
    monkeypatch.setattr(Eagle3Drafter, "qkv", lambda self, hidden, tokens, positions, *rest: (
        seen.append(positions), qkv(self, hidden, tokens, positions, *rest))[1])
    batch = padded_batch(LENGTHS, drafter())
    run_batch(batch, PACK)
    own = pack(batch, PACK)["positions"]
    assert len(seen) == K and all(torch.equal(p, own + k) for k, p in enumerate(seen))


def test_packed_teacher_rows_are_the_documents_own():
    """No teacher row at a document's last token (its next token is another document's)."""
    d = drafter()
    batch = padded_batch(LENGTHS, d)
    p = pack(batch, PACK)
    head = lm_head(d)[d.t2d]
    alone = teacher_targets(batch["final"], batch["valid"], head, d.t2d, batch["argmax"], None, batch["teacher_lse"])
    packed = teacher_targets(p["final"], p["valid"], head, d.t2d, p["argmax"], p["doc_ids"], p["teacher_lse"])
    repacked = pack({"valid": batch["valid"], **alone._asdict()}, PACK)
    for name in ("p", "top", "in_vocab"):
        assert torch.equal(getattr(packed, name), repacked[name]), name
    inside = p["valid"].bool()  # the draft vocab's mass: 1 on the rows padding a pack, as on any non-teacher row
    assert torch.equal(packed.mass[inside], repacked["mass"][inside]) and (packed.mass[inside] < 1).any()


def test_a_document_never_reads_another():
    """Document 0 (first in row 0) untrained and then replaced by other tokens and hidden states:
    document 1, after it in the same row, trains exactly as before."""
    batch = padded_batch(LENGTHS, drafter())
    batch["loss_mask"][0] = 0
    other = padded_batch(LENGTHS, drafter(), seed=9)
    changed = {**batch, **{k: torch.cat([other[k][:1], batch[k][1:]]) for k in ("input_ids", "aux", "final", "argmax")}}
    before = run_batch(batch, PACK)
    assert before[1]["count"].min() >= 3
    assert_same(before, run_batch(changed, PACK))


def doc_ids_of(runs, t):
    """[(document length) ...] -> [1,t] ids 0, 1, ... then -1 to t."""
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(runs)])
    return torch.cat([ids, torch.full((t - ids.numel(),), -1)])[None]


def test_document_block_mask_visits_exactly_the_blocks_holding_a_same_document_pair():
    """Full blocks exactly where every pair may attend, partial where some may, none elsewhere."""
    t, steps = 4 * BLOCK, 2
    doc_ids = doc_ids_of([300, 100, 50], t)  # document 0 spans blocks 0-2, padding fills block 3
    bm = ttt_block_mask(t, steps, torch.device("cpu"), doc_ids)
    pos, kv = torch.arange(t), torch.arange(t * steps)
    same = doc_ids[0, kv % t][None] == doc_ids[0][:, None]
    pairs = torch.where(kv[None] < t, (kv[None] <= pos[:, None]) & same, kv[None] % t == pos[:, None])  # [t,t*steps]
    blocks = pairs.view(4, BLOCK, 4 * steps, BLOCK)
    for num, idx, want in ((bm.kv_num_blocks, bm.kv_indices, blocks.any((1, 3)) & ~blocks.all((1, 3))),
                           (bm.full_kv_num_blocks, bm.full_kv_indices, blocks.all((1, 3)))):
        got = torch.zeros_like(want)
        for i in range(4):
            got[i, idx[0, 0, i, :num[0, 0, i]].long()] = True
        assert torch.equal(got, want)
    assert blocks.all((1, 3))[1, 0] and not blocks.any((1, 3))[3, 0]  # the case has full and skipped blocks


# flex's unfused eager kernel on purpose: the mask's math, checked where CI runs (CUDA compiles it)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_document_mask_attention_equals_dense():
    g = torch.Generator().manual_seed(2)
    t = 3 * BLOCK
    doc_ids = torch.cat([doc_ids_of([200, 60, 70], t), doc_ids_of([130, 1, 127], t)])  # boundaries in and at blocks
    for steps in (1, 3):
        q = torch.randn(2, 4, t, 16, generator=g)
        keys = [torch.randn(2, 2, t, 16, generator=g) for _ in range(steps)]
        values = [torch.randn(2, 2, t, 16, generator=g) for _ in range(steps)]
        dense = dense_ttt_attention(q, keys, values, doc_ids)
        flex = flex_ttt_attention(q, keys, values, ttt_block_mask(t, steps, q.device, doc_ids), compiled=False)
        torch.testing.assert_close(flex, dense, **TOL)


def test_packed_ttt_loss_with_flex_attention_equals_dense(monkeypatch):
    """Rows of 200 tokens, padded to 256 for flex: the whole packed unroll's loss and sums."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(ttt_attention, "_compiled_flex", lambda: flex_attention)
    d = drafter()
    p = pack(padded_batch([90, 70, 120, 60], d), 200)
    teacher = teacher_targets(p["final"], p["loss_mask"], lm_head(d)[d.t2d], d.t2d, p["argmax"], p["doc_ids"])
    rows = Rows(p["aux"], p["input_ids"], p["loss_mask"], p["doc_ids"], p["positions"])
    with torch.no_grad():
        dense = ttt_loss(d, rows, teacher, K, 0.8)
        flex = ttt_loss(d, rows, teacher, K, 0.8, StepOptions("flex"))
    torch.testing.assert_close(flex[0], dense[0], **TOL)
    for key in dense[1]:
        torch.testing.assert_close(flex[1][key], dense[1][key], **TOL)
    assert p["aux"].shape[0] == 2 and dense[1]["count"].min() > 10
