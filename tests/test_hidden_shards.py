"""Shard round trip, resume after a simulated crash, and corruption detection (real safetensors)."""

import json
import os

import pytest
import torch

from core.storage.hidden_shards import INDEX, HiddenShards, ShardWriter, shard_name
from tests.conftest import trained_next

H = 8


def sample(i: int, t: int):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 1000, (t,), generator=g)
    mask = (torch.arange(t) >= t // 2).to(torch.uint8)
    return ids, mask, torch.randn(t, 3 * H, generator=g), torch.randn(t, H, generator=g)


def test_round_trip_many_shards(tmp_path):
    with ShardWriter(tmp_path, H, "fp32", shard_mb=0) as w:  # shard_mb=0: one shard per sample
        for i in range(5):
            w.add(f"s{i}", *sample(i, 10 + i))
    r = HiddenShards(tmp_path)
    assert r.ids == [f"s{i}" for i in range(5)] and r.num_tokens() == sum(10 + i for i in range(5))
    assert len(list(tmp_path.glob("shard-*.safetensors"))) == 5
    for i in range(5):
        got, want = r.load(f"s{i}"), sample(i, 10 + i)
        for k, v in zip(("input_ids", "loss_mask", "aux", "final"), want, strict=True):
            assert torch.equal(got[k], v.to(got[k].dtype)), k


def test_bf16_storage_is_close(tmp_path):
    with ShardWriter(tmp_path, H, "bf16", shard_mb=64) as w:
        w.add("a", *sample(0, 7))
        w.add("b", *sample(1, 9))
    r = HiddenShards(tmp_path)
    assert len(list(tmp_path.glob("shard-*"))) == 1
    got = r.load("b")
    assert got["aux"].dtype == torch.bfloat16
    torch.testing.assert_close(got["aux"].float(), sample(1, 9)[2], rtol=1e-2, atol=1e-2)


def test_resume_after_crash_loses_and_duplicates_nothing(tmp_path):
    w = ShardWriter(tmp_path, H, "fp32", shard_mb=0)
    w.add("s0", *sample(0, 5))
    w.add("s1", *sample(1, 5))
    # crash 1: a shard committed but killed before its index line; crash 2: a torn index line
    w.flush()
    with ShardWriter(tmp_path, H, "fp32", shard_mb=1024) as w2:
        w2.add("s2", *sample(2, 5))
    index = tmp_path / INDEX
    lines = index.read_text().splitlines(keepends=True)
    index.write_text("".join(lines[:2]) + lines[2][:20])  # s2's line torn mid-write
    (tmp_path / f".{shard_name(3)}.tmp4194305").write_bytes(b"half a shard")  # crash 3: killed mid-write
    (tmp_path / f".{shard_name(4)}.tmp{os.getpid()}").write_bytes(b"live")  # a running writer's: kept
    w3 = ShardWriter(tmp_path, H, "fp32", shard_mb=0)
    assert [p.name for p in tmp_path.glob(".shard-*")] == [f".{shard_name(4)}.tmp{os.getpid()}"]
    (tmp_path / f".{shard_name(4)}.tmp{os.getpid()}").unlink()
    assert w3.done == {"s0", "s1"}
    assert not (tmp_path / shard_name(2)).exists()  # orphan of the torn line removed
    for i in (2, 3):
        w3.add(f"s{i}", *sample(i, 5))
    w3.flush()
    r = HiddenShards(tmp_path)
    assert r.ids == ["s0", "s1", "s2", "s3"]
    for i in range(4):
        assert torch.equal(r.load(f"s{i}")["input_ids"], sample(i, 5)[0].int())


def test_bad_samples_are_rejected(tmp_path):
    w = ShardWriter(tmp_path, H, "fp32")
    ids, mask, aux, final = sample(0, 6)
    with pytest.raises(ValueError, match=r"aux \(6, 8\) / final \(6, 8\) rows for T=6 tokens, H=8"):
        w.add("x", ids, mask, aux[:, :H], final)
    with pytest.raises(ValueError, match="non-finite"):
        w.add("x", ids, mask, aux * float("nan"), final)
    w.add("x", ids, mask, aux, final)
    with pytest.raises(ValueError, match="written twice"):
        w.add("x", ids, mask, aux, final)


def test_corrupt_shard_is_detected(tmp_path):
    with ShardWriter(tmp_path, H, "fp32") as w:
        w.add("a", *sample(0, 6))
    index = tmp_path / INDEX
    index.write_text(index.read_text().replace('"sha256": "', '"sha256": "0'))
    with pytest.raises(ValueError, match="hash mismatch"):
        HiddenShards(tmp_path).load("a")


def test_fp8_rows_keep_each_layer_to_e4m3_precision(tmp_path):
    """One scale per token and layer: a layer 1000x smaller than its neighbour keeps its precision."""
    ids, mask, aux, final = sample(3, 40)
    aux = aux * torch.tensor([1.0, 1e-3, 1e3]).repeat_interleave(H)  # layers of very different scale
    with ShardWriter(tmp_path, H, "fp8_e4m3") as w:
        w.add("a", ids, mask, aux, final)
    got = HiddenShards(tmp_path).load("a")
    assert got["aux"].dtype == torch.float32 and torch.equal(got["input_ids"], ids.int())
    for want, have, groups in ((aux, got["aux"], 3), (final, got["final"], 1)):
        w_, h_ = want.reshape(40, groups, -1), have.reshape(40, groups, -1)
        step = w_.abs().amax(-1, keepdim=True) / 448 * 2**-6  # e4m3's smallest normal, in group units
        assert ((h_ - w_).abs() <= 2**-4 * w_.abs() + step).all()
        assert ((h_ - w_).abs() / w_.abs().amax(-1, keepdim=True)).max() > 0  # it really was quantized


def test_fp8_bytes_per_token_about_half_of_bf16(tmp_path):
    h = 576  # SmolLM2's hidden size
    sizes = {}
    for dtype in ("bf16", "fp8_e4m3"):
        with ShardWriter(tmp_path / dtype, h, dtype) as w:
            for i in range(4):
                g = torch.Generator().manual_seed(i)
                w.add(f"s{i}", torch.arange(64), torch.ones(64), torch.randn(64, 3 * h, generator=g),
                      torch.randn(64, h, generator=g))
        sizes[dtype] = sum(p.stat().st_size for p in (tmp_path / dtype).glob("shard-*"))
    assert sizes["fp8_e4m3"] <= 0.55 * sizes["bf16"]


@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3"])
def test_loss_spans_keep_final_only_where_the_loss_reads_it(tmp_path, dtype):
    samples = {f"s{i}": sample(i, 9 + i) for i in range(4)}
    with ShardWriter(tmp_path / "all", H, dtype, shard_mb=0) as w_all, \
            ShardWriter(tmp_path / "loss", H, dtype, shard_mb=0, spans="loss") as w_loss:
        for sid, s in samples.items():
            w_all.add(sid, *s)
            w_loss.add(sid, *s)
    full, sparse = HiddenShards(tmp_path / "all"), HiddenShards(tmp_path / "loss")
    assert full.final_everywhere and not sparse.final_everywhere
    for sid, (_, mask, _, _) in samples.items():
        a, b = full.load(sid), sparse.load(sid)
        need = torch.tensor(trained_next(mask.tolist()))
        assert torch.equal(a["aux"], b["aux"]) and torch.equal(a["final"][need], b["final"][need])
        assert not b["final"][~need].any() and b["final"][need].abs().sum() > 0
    size = {k: sum(p.stat().st_size for p in (tmp_path / k).glob("shard-*")) for k in ("all", "loss")}
    assert size["loss"] < size["all"]
    index = tmp_path / "loss" / INDEX  # a final_length that disagrees with the mask is corruption
    rows = [json.loads(line) for line in index.read_text().splitlines()]  # commit threads: any line order
    for r in rows:
        r["final_length"] -= r["id"] == "s0"
    index.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="final rows for 5 loss positions"):
        HiddenShards(tmp_path / "loss").load("s0")


def test_engine_rows_of_other_tokens_are_rejected(tmp_path):
    w = ShardWriter(tmp_path, H, "fp32")
    ids, mask, aux, final = sample(0, 6)
    with pytest.raises(ValueError, match="token ids differ"):
        w.add("x", ids, mask, aux, final, seen_ids=ids.roll(1))
    w.add("x", ids, mask, aux, final, seen_ids=ids.clone())
    assert not w.done and len(w._buf) == 1


def test_write_safetensors_is_read_by_safetensors_itself(tmp_path):
    from safetensors.torch import load_file

    from core.storage.fp8_rows import FP8
    from core.storage.hidden_shards import write_safetensors

    tensors = {"aux": torch.randn(5, 6).bfloat16(), "f32": torch.randn(3), "q": torch.randn(4, 2).to(FP8),
               "ids": torch.arange(7, dtype=torch.int32), "mask": torch.tensor([1, 0, 1], dtype=torch.uint8),
               "empty": torch.zeros(0, 4)}
    write_safetensors(tmp_path / "x.safetensors", {k: [v[:2], v[2:]] for k, v in tensors.items()})  # in 2 chunks
    got = load_file(tmp_path / "x.safetensors")
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_teacher_argmax_over_several_samples_per_product_matches_one_sample_at_a_time(tmp_path):
    """train's precompute_teacher batches the rows of several samples into one lm_head product: each sample
    gets back its own rows' argmax and logsumexp, in place (a sample with no answer rows and max_len cuts
    included)."""
    from train.data import precompute_teacher

    lengths = [12, 7, 20, 9, 15]
    with ShardWriter(tmp_path, H, "fp32", shard_mb=64) as w:
        for i, t in enumerate(lengths):
            ids, mask, aux, final = sample(i, t)
            w.add(f"s{i}", ids, mask * 0 if i == 1 else mask, aux, final)
    shards, head = HiddenShards(tmp_path), torch.randn(50, H)
    for on_prompt in (False, True):
        want, want_lse = {}, {}
        for i in range(len(lengths)):
            s = shards.load(f"s{i}")
            need = torch.ones_like(s["loss_mask"]) if on_prompt else s["loss_mask"]
            need = torch.cat([need[1:], need.new_zeros(1)]).bool()  # positions whose next token counts
            need[14:] = False
            logits = s["final"] @ head.T  # one sample at a time
            want[f"s{i}"] = torch.where(need, logits.argmax(-1), 0)
            want_lse[f"s{i}"] = torch.where(need, torch.logsumexp(logits, -1), 0)
        for rows_per_call in (1, 8, 4096):
            got = precompute_teacher(shards, head, 14, on_prompt, rows_per_call)
            assert all(torch.equal(got["argmax"][k], v) for k, v in want.items()), (on_prompt, rows_per_call)
            for k, v in want_lse.items():
                torch.testing.assert_close(got["teacher_lse"][k], v, rtol=1e-6, atol=1e-5)
