"""Shard round trip, resume after a simulated crash, and corruption detection (real safetensors)."""

import pytest
import torch

from core.hidden_shards import INDEX, HiddenShards, ShardWriter, shard_name

H = 8


def sample(i: int, t: int):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 1000, (t,), generator=g)
    mask = (torch.arange(t) >= t // 2).to(torch.uint8)
    return ids, mask, torch.randn(t, 3 * H, generator=g), torch.randn(t, H, generator=g)


def test_round_trip_many_shards(tmp_path):
    with ShardWriter(tmp_path, H, "float32", shard_mb=0) as w:  # shard_mb=0: one shard per sample
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
    with ShardWriter(tmp_path, H, "bfloat16", shard_mb=64) as w:
        w.add("a", *sample(0, 7))
        w.add("b", *sample(1, 9))
    r = HiddenShards(tmp_path)
    assert len(list(tmp_path.glob("shard-*"))) == 1
    got = r.load("b")
    assert got["aux"].dtype == torch.bfloat16
    torch.testing.assert_close(got["aux"].float(), sample(1, 9)[2], rtol=1e-2, atol=1e-2)


def test_resume_after_crash_loses_and_duplicates_nothing(tmp_path):
    w = ShardWriter(tmp_path, H, "float32", shard_mb=0)
    w.add("s0", *sample(0, 5))
    w.add("s1", *sample(1, 5))
    # crash 1: a shard committed but killed before its index line; crash 2: a torn index line
    w.flush()
    with ShardWriter(tmp_path, H, "float32", shard_mb=1024) as w2:
        w2.add("s2", *sample(2, 5))
    index = tmp_path / INDEX
    lines = index.read_text().splitlines(keepends=True)
    index.write_text("".join(lines[:2]) + lines[2][:20])  # s2's line torn mid-write
    w3 = ShardWriter(tmp_path, H, "float32", shard_mb=0)
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
    w = ShardWriter(tmp_path, H, "float32")
    ids, mask, aux, final = sample(0, 6)
    with pytest.raises(ValueError, match="do not match T=6"):
        w.add("x", ids, mask, aux[:, :H], final)
    with pytest.raises(ValueError, match="non-finite"):
        w.add("x", ids, mask, aux * float("nan"), final)
    w.add("x", ids, mask, aux, final)
    with pytest.raises(ValueError, match="written twice"):
        w.add("x", ids, mask, aux, final)


def test_corrupt_shard_is_detected(tmp_path):
    with ShardWriter(tmp_path, H, "float32") as w:
        w.add("a", *sample(0, 6))
    index = tmp_path / INDEX
    index.write_text(index.read_text().replace('"sha256": "', '"sha256": "0'))
    with pytest.raises(ValueError, match="hash mismatch"):
        HiddenShards(tmp_path).load("a")
