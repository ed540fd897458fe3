"""Few-row Linear products split across threads (core/engine/cpu_linear.py): F.linear's values, on the path meant."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.engine import cpu_linear
from core.engine.cpu_linear import MAX_ROWS, SplitLinear, split_cpu_linears, split_linear
from core.engine.decode import generate
from core.run.config import load_config
from core.target.chat import prompt_ids
from core.target.model import end_of_turn_ids, load_target
from tests.conftest import ROOT


@pytest.fixture
def two_threads():
    """`make test` runs each worker on one thread, where split_linear is plain F.linear."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def bmm_calls(monkeypatch):
    calls = []
    real = torch.bmm

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(cpu_linear.torch, "bmm", counted)
    return calls


@pytest.mark.parametrize("shape", [(1, 576), (6, 576), (1, 1, 576), (2, 3, 576), (MAX_ROWS, 576), (MAX_ROWS + 1, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_product_gives_f_linear_values(two_threads, bmm_calls, shape, bias):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(1536, 576)
    b = torch.randn(1536) if bias else None
    out = split_linear(x, w, b)
    assert out.shape == (*shape[:-1], 1536)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    rows = x.numel() // 576
    assert len(bmm_calls) == (1 if rows <= MAX_ROWS else 0), (rows, bmm_calls)


def test_one_thread_keeps_f_linear(bmm_calls):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        split_linear(torch.randn(1, 64), torch.randn(128, 64), None)
    finally:
        torch.set_num_threads(before)
    assert bmm_calls == []


def test_only_fp32_cpu_linears_with_divisible_rows_are_switched():
    m = nn.ModuleDict({"a": nn.Linear(64, 128), "odd": nn.Linear(64, 130), "bf16": nn.Linear(64, 128).to(torch.bfloat16),
                       "emb": nn.Embedding(10, 64)})
    state = {k: v.clone() for k, v in m.state_dict().items()}
    split_cpu_linears(m)
    assert type(m["a"]) is SplitLinear and type(m["odd"]) is nn.Linear and type(m["bf16"]) is nn.Linear
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())


def test_the_target_decodes_the_same_tokens_split_or_not(two_threads, bmm_calls):
    """SmolLM2 as load_target gives it (every fp32 Linear split, lm_head tied to the embedding) greedy-decodes
    the tokens of the same model with plain Linears, batch 1 (the split path) and batch 3."""
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml")
    model, tok = load_target(cfg)
    assert type(model.lm_head) is SplitLinear and model.lm_head.weight is model.model.embed_tokens.weight
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in ("Name a prime number.", "Say hi.", "2+2?")]
    stop = end_of_turn_ids(tok, model.generation_config)
    split = [generate(model, prompts[:1], 8, stop)[0].tokens] + [g.tokens for g in generate(model, prompts, 8, stop)]
    assert bmm_calls, "the split path was never taken"
    for m in model.modules():
        if type(m) is SplitLinear:
            m.__class__ = nn.Linear
    plain = [generate(model, prompts[:1], 8, stop)[0].tokens] + [g.tokens for g in generate(model, prompts, 8, stop)]
    assert split == plain
