"""GPU only (skipped elsewhere): shard rows written through the pinned, non-blocking device-to-host
copies equal a fresh single-sample forward. Ran on the lent H200 (docs/PERFORMANCE.md)."""

import pytest
import torch
from datasets import Dataset

from core.storage.hidden_shards import HiddenShards, ShardWriter
from core.target.hidden_capture import extract_batch
from extract.run import extract_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Bar:
    def update(self, n):
        pass


@pytest.mark.parametrize("dtype, bound", [("bf16", 2e-2), ("fp8_e4m3", 8e-2)])
def test_gpu_shard_rows_equal_a_fresh_forward(tmp_path, dtype, bound):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(512, 1025, (48,), generator=g).tolist()  # ~37k tokens
    rows = Dataset.from_dict({"id": [f"s{i}" for i in range(48)],
                              "input_ids": [torch.randint(0, 1000, (t,), generator=g).tolist() for t in lengths],
                              "loss_mask": [[0] * (t // 3) + [1] * (t - t // 3) for t in lengths]})
    with ShardWriter(tmp_path, 256, dtype, shard_mb=4) as w:  # many shards, two in flight
        extract_hf(model, rows, [len(x) for x in rows["input_ids"]], [1, 3, 4], w, Bar(), 8192, "bf16")
    shards = HiddenShards(tmp_path)
    assert len(shards) == len(rows) and len(list(tmp_path.glob("shard-*"))) > 2
    for i, sid in enumerate(rows["id"]):
        (_, aux, final), = extract_batch(model, [rows[i]["input_ids"]], [1, 3, 4])
        got = shards.load(sid)
        for a, b in ((got["aux"].float(), aux.float().cpu()), (got["final"].float(), final.float().cpu())):
            assert ((a - b).abs() / (b.abs() + 1)).max().item() < bound
