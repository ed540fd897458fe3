"""DFlash block drafters (core/drafters/dflash.py, train/dflash_loss.py): what training computes for a block is what the
engine computes when it drafts that block, decoding with one is lossless, the export round-trips, and SGLang
0.5.23's own DFlash loader takes it whole. llama.cpp serving the same drafter at our engine's acceptance:
tests/test_llamacpp_serving.py."""

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file

from core.drafters.dflash import ContextCache, DFlashConfig, DFlashDrafter, dflash_generate, draft_block
from core.engine.decode import generate
from core.run.config import load_config
from core.target.hidden_capture import extract_batch
from core.target.model import load_target
from tests.conftest import ROOT, run_stage
from tests.sglang_source import LLAMA_FILE, SGLANG, build_sglang_dflash, check_sglang_dflash_load
from train.dflash_loss import DFlashObjective, block_mask, draw_anchors
from train.ttt_loss import Teacher


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_target(load_config(ROOT / "configs/tiny-random-llama.yaml"))
    return model


def random_drafter(model, block: int = 5, layers: int = 2, seed: int = 0) -> DFlashDrafter:
    c = model.config
    torch.manual_seed(seed)
    config = DFlashConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                          num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                          head_dim=c.hidden_size // c.num_attention_heads, num_hidden_layers=layers,
                          vocab_size=c.vocab_size, target_hidden_size=c.hidden_size,
                          target_num_layers=c.num_hidden_layers, block_size=block, mask_token_id=c.vocab_size - 1,
                          aux_layers=[1, 2, 3], rope_theta=c.rope_parameters["rope_theta"])
    d = DFlashDrafter(config, model.model.embed_tokens.weight, model.lm_head.weight)
    for p in d.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.2 if p.dim() == 1 else 0.05)
    d.aux_scale.copy_(torch.rand_like(d.aux_scale) + 0.5)
    return d.eval()


def test_training_computes_the_block_the_engine_drafts(tiny):
    """For each anchor a, the training forward's block rows (block mask over the whole sample's context) give the
    logits the engine's draft_block computes after position a (context = the states of positions < a only)."""
    d = random_drafter(tiny)
    ids = torch.randint(0, 1000, (20,)).tolist()
    (_, aux, _), = extract_batch(tiny, [ids], d.config.aux_layers)
    block, t = d.config.block_size, len(ids)
    anchors = torch.tensor([1, 6, 13])
    slots = anchors[:, None] + torch.arange(block)
    tokens = torch.full_like(slots, d.config.mask_token_id)
    tokens[:, 0] = torch.tensor(ids)[anchors]
    with torch.no_grad():
        ctx_kv = d.context_kv(d.context(aux[None]), torch.arange(t)[None])
        trained = d.block_logits(tokens.flatten()[None], slots.flatten()[None], ctx_kv,
                                 block_mask(anchors, t, block)[None, None])[0].view(3, block, -1)
        for i, a in enumerate(anchors.tolist()):
            ctx = ContextCache(d)
            ctx.append(aux[None, :a])
            torch.testing.assert_close(trained[i, 1:], draft_block(d, ids[a], ctx, block - 1), atol=1e-4, rtol=1e-4)


def test_a_block_sees_no_context_at_or_after_its_anchor_and_all_of_its_block():
    mask = block_mask(torch.tensor([2, 5]), 8, 3)
    assert mask.shape == (6, 8 + 6)
    assert mask[:3, :8].tolist() == [[True, True] + [False] * 6] * 3
    assert mask[3:, :8].tolist() == [[True] * 5 + [False] * 3] * 3
    assert mask[:3, 8:].tolist() == [[True] * 3 + [False] * 3] * 3 and mask[3:, 8:].tolist() == [[False] * 3 + [True] * 3] * 3


def test_anchors_are_drawn_where_the_next_token_is_trained_on():
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
    g = torch.Generator().manual_seed(0)
    assert draw_anchors(loss_mask, 100, g).tolist() == [2, 3, 4, 7, 8]  # next token trained, a >= 1, a < T - 1
    assert draw_anchors(loss_mask, 2, g).numel() == 2


def test_the_loss_counts_only_trained_slots_and_learns(tiny):
    """Slot j of the block at anchor a is counted iff token a + j is trained on and inside the sample; a few steps
    on one sample lower the loss."""
    d = random_drafter(tiny, block=4, layers=1)
    ids = torch.randint(0, 1000, (1, 16))
    (_, aux, final), = extract_batch(tiny, ids.tolist(), d.config.aux_layers)
    loss_mask = torch.zeros(1, 16, dtype=torch.long)
    loss_mask[0, 8:] = 1
    p = torch.softmax(final @ tiny.lm_head.weight.T, -1)[None]
    teacher = Teacher(p, p.argmax(-1), torch.ones(1, 16, dtype=torch.bool), torch.ones(1, 16))
    objective = DFlashObjective(d.train(), decay=0.8, anchors=64, seed=0)
    loss0, sums = objective(aux[None], ids, loss_mask, teacher)
    # anchors 7..14 (next token trained): slot j counts where a + j <= 15; slots 1, 2, 3 -> 8, 7, 6 rows
    assert sums["count"].tolist() == [8.0, 7.0, 6.0]
    opt = torch.optim.Adam([q for q in d.parameters() if q.requires_grad], lr=3e-3)
    for _ in range(30):
        loss, _ = objective(aux[None], ids, loss_mask, teacher)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.9 * loss0.item()


def test_a_batch_trains_what_its_samples_train_alone(tiny):
    """The objective's one batched forward (blocks padded to the batch's most anchors, the fused head loss over the
    counted rows) gives the loss, per-slot sums and gradients of each sample's blocks computed alone with plain
    autograd, the same anchors drawn: samples of other trained spans, one with nothing to train on."""
    d, n, t, block = random_drafter(tiny, block=4, layers=2), 3, 18, 4
    params = [q for q in d.parameters() if q.requires_grad]
    ids = torch.randint(0, 1000, (n, t))
    rows = extract_batch(tiny, ids.tolist(), d.config.aux_layers)
    aux = torch.stack([r[1] for r in rows])
    p = torch.softmax(torch.stack([r[2] for r in rows]) @ tiny.lm_head.weight.T, -1)
    loss_mask = torch.zeros(n, t, dtype=torch.long)
    loss_mask[0, 5:], loss_mask[1, 1:3], loss_mask[1, 10:13] = 1, 1, 1  # sample 1: 4 anchors, 2 padded at 0
    loss, sums = DFlashObjective(d, decay=0.8, anchors=6, seed=0, loss_chunk=7)(  # fused head loss, 7 rows a chunk
        aux, ids, loss_mask, Teacher(p, p.argmax(-1), None, torch.ones(n, t)), generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(loss, params)
    g, weights = torch.Generator().manual_seed(7), 0.8 ** torch.arange(block - 1.0)
    total, loss_sum, count = 0.0, torch.zeros(block - 1), torch.zeros(block - 1)
    for b in range(n):
        a = draw_anchors(loss_mask[b], 6, g)
        if b == 2:
            assert a.numel() == 0
            continue
        slots = a[:, None] + torch.arange(block)
        tokens = torch.full_like(slots, d.config.mask_token_id)
        tokens[:, 0] = ids[b, a]
        ctx_kv = d.context_kv(d.context(aux[b: b + 1]), torch.arange(t)[None])
        logits = d.block_logits(tokens.flatten()[None], slots.flatten()[None], ctx_kv,
                                block_mask(a, t, block)[None, None])[0].view(len(a), block, -1)[:, 1:]
        target = slots[:, 1:]
        w = ((target < t) & loss_mask[b, target.clamp(max=t - 1)].bool()).float()
        ce = -(p[b, (target - 1).clamp(max=t - 1)] * torch.log_softmax(logits, -1)).sum(-1)
        total, loss_sum, count = total + (ce * w * weights).sum(), loss_sum + (ce * w).sum(0), count + w.sum(0)
    want = total / (count * weights).sum()
    assert sums["count"].tolist() == count.tolist() and count[0] > 0
    torch.testing.assert_close(sums["loss_sum"], loss_sum.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for got, ref, q in zip(grads, torch.autograd.grad(want, params), params, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6, msg=lambda m, q=q: f"{tuple(q.shape)}: {m}")


def test_dflash_decoding_equals_greedy(tiny):
    d = random_drafter(tiny)
    for seed in range(3):
        prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        greedy = generate(tiny, [prompt], 24, [])[0]
        spec = dflash_generate(tiny, d, prompt, 24, [], steps=4)
        assert spec.tokens == greedy.tokens and 1 + sum(spec.accept_lengths) == len(spec.tokens)
        assert all(1 <= a <= 5 for a in spec.accept_lengths)


def test_the_export_is_what_the_engine_loads(tiny, tmp_path):
    """aux_scale folded into fc, bf16 weights, the target's embedding and head borrowed: the loaded drafter drafts
    what the trained one drafts."""
    d = random_drafter(tiny)
    d.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path, tiny.model.embed_tokens.weight, tiny.lm_head.weight, "llama",
                                           tiny.config.num_hidden_layers)
    aux = torch.randn(1, 9, 3 * tiny.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.context(aux), d.context(aux), atol=0.05, rtol=0.05)  # bf16 rounding
    assert loaded.config == d.config
    cfg = (tmp_path / "config.json").read_text()
    assert '"target_layer_ids": [\n      0,\n      1,\n      2\n    ]' in cfg  # output of layer i = our input of i + 1


def test_sglang_loads_the_export_whole_and_captures_the_trained_layers(tiny, tmp_path):
    """SGLang 0.5.23's DFlashDraftModel, built by its real constructors from our config.json (parsed by its
    parse_dflash_draft_config), takes every tensor of our export through its real load_weights (it drops unknown
    names without a word: none may be dropped) and leaves no parameter unloaded; its Llama target's
    set_dflash_layers_to_capture turns the checkpoint's output-of-layer ids into the aux layers we trained on."""
    d = random_drafter(tiny)
    d.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    model, record = build_sglang_dflash(config)
    assert check_sglang_dflash_load(model, record, load_file(str(tmp_path / "model.safetensors"))) == []
    parsed = model.draft_config
    assert (parsed.block_size, parsed.mask_token_id, parsed.target_layer_ids) == (5, d.config.mask_token_id, [0, 1, 2])
    capture = SGLANG.compile_function(LLAMA_FILE, "LlamaForCausalLM", "set_dflash_layers_to_capture", {})
    target = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace())
    capture(target, parsed.target_layer_ids)
    assert target.model.layers_to_capture == d.config.aux_layers == [1, 2, 3]


def test_a_stopped_dflash_run_resumes_to_the_uninterrupted_weights(tmp_path):
    """train.stop_after, then a rerun: the same exported weights as one run straight through (anchors come from each
    batch's own random stream, so the rerun draws what the uninterrupted run drew)."""
    tiny = ["--config", "configs/tiny-random-llama.yaml"]
    base = tmp_path / "data"
    run_stage("data_gen", *tiny, "--run-dir", str(base), "data_gen.num_samples=8")
    run_stage("extract", *tiny, "--run-dir", str(base), "extract.dtype=fp32")
    train = ["train.drafter=dflash", "train.dflash.block_size=4", "train.epochs=2", "train.batch_size=2",
             "train.wandb_mode=disabled", "train.mixed_precision=fp32"]
    for name in ("straight", "stopped"):
        for stage in ("conversations", "hidden"):
            shutil.copytree(base / stage, tmp_path / name / stage)
    run_stage("train", *tiny, "--run-dir", str(tmp_path / "straight"), *train)
    run_stage("train", *tiny, "--run-dir", str(tmp_path / "stopped"), *train, "train.stop_after=3")
    assert not (tmp_path / "stopped/drafter").exists()
    run_stage("train", *tiny, "--run-dir", str(tmp_path / "stopped"), *train)
    a, b = (load_file(str(tmp_path / name / "drafter/model.safetensors")) for name in ("straight", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
