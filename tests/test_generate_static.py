"""Batched generation's static loop (core/decode.generate over core/decode_step.DecodeStep) against the
plain loop it replaced, restated below: the same tokens at T=0, and at T>0 the same draws with the
generator left where the plain loop leaves it, whatever the interval of the "every row done?" check."""

import pytest
import torch

import core.engine.decode_step
from core.engine.decode import DecodeRun, Sampling, decode_one, generate, new_cache, prefill
from core.run.config import load_config
from core.target.chat import prompt_ids
from core.target.model import load_target
from data_gen.generate import decode_options, generation_settings
from tests.conftest import ROOT

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.", "Hi"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_target(load_config(ROOT / "configs/tiny-random-llama.yaml"))
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)  # every row padded differently
    return model, prompts


def plain_generate(model, prompts, n, stop_ids, temperature=0.0, generator=None) -> list[list[int]]:
    """The loop before the static one: a mask grown by one column a step, every row's token read on the
    host every step, and the loop left as soon as every row has hit a stop id."""
    b, width, device = len(prompts), max(len(p) for p in prompts), model.device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(model, width + n)
    with torch.inference_mode():
        logits, _ = prefill(model, cache, ids, mask, pos)
        out, done = [[] for _ in prompts], [False] * b
        for step in range(n):
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t in stop_ids
            if all(done) or step + 1 == n:
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=device)], 1)
            logits = decode_one(model, cache, nxt, width + step, mask, pos[:, -1:] + 1 + step)
    return out


def stops_at(free: list[list[int]], at: dict[int, int]) -> list[int]:
    """Stop ids that end row r at its token at[r] (picked from the rows' unstopped output)."""
    return sorted({free[r][i] for r, i in at.items()})


def count_steps(monkeypatch) -> list[int]:
    calls = []
    step = core.engine.decode_step.DecodeStep.__call__
    monkeypatch.setattr(core.engine.decode_step.DecodeStep, "__call__", lambda self, t: (calls.append(1), step(self, t))[1])
    return calls


@pytest.mark.parametrize("check_every", [1, 5, 16])
def test_greedy_rows_that_stop_early_or_run_to_the_limit_equal_the_plain_loop(tiny, check_every):
    model, prompts = tiny
    stop = stops_at(plain_generate(model, prompts, 12, []), {0: 2, 1: 5})
    want = plain_generate(model, prompts, 12, stop)
    assert [len(t) for t in want] == [3, 6, 12, 12]
    got = generate(model, prompts, 12, stop, check_every=check_every)
    assert [g.tokens for g in got] == want
    assert [g.finish_reason for g in got] == ["stop", "stop", "length", "length"]


def test_the_loop_ends_at_the_first_check_after_every_row_stopped(tiny, monkeypatch):
    model, prompts = tiny
    stop = stops_at(plain_generate(model, prompts, 16, []), {0: 2, 1: 6, 2: 4, 3: 1})
    want = plain_generate(model, prompts, 16, stop)
    assert max(len(t) for t in want) == 7  # the last row stops at step 6
    steps = count_steps(monkeypatch)
    assert [g.tokens for g in generate(model, prompts, 16, stop, check_every=4)] == want
    assert len(steps) == 7  # steps 0..6 decode; the check after step 7 sees every row done
    steps.clear()
    assert [g.tokens for g in generate(model, prompts, 16, [], check_every=4)] == plain_generate(model, prompts, 16, [])
    assert len(steps) == 15  # no stop: every step but the last decodes


@pytest.mark.parametrize("rows", [1, 3])
def test_a_cpu_prefill_in_groups_of_rows_gives_the_one_pass_logits_and_tokens(tiny, monkeypatch, rows):
    """Many prompts on a CPU are prefilled CPU_PREFILL_TOKENS at a time, each group into a scratch cache whose
    K/V then fill the static one: the one pass's last logits, and the same greedy tokens and stops after."""
    import core.engine.decode

    _, prompts = tiny  # on the CPU also where a GPU is: a GPU prefills every row in one pass
    model, _ = load_target(load_config(ROOT / "configs/tiny-random-llama.yaml"), torch.device("cpu"))
    width = max(len(p) for p in prompts)
    stop = stops_at(plain_generate(model, prompts, 12, []), {0: 2, 1: 5})
    want = plain_generate(model, prompts, 12, stop)  # 4 prompts of < 100 tokens: one pass at 2048
    ids, mask, pos = core.engine.decode.left_padded(prompts, model.device)
    with torch.inference_mode():
        one = prefill(model, new_cache(model, width + 4), ids, mask, pos)[0]
        monkeypatch.setattr(core.engine.decode, "CPU_PREFILL_TOKENS", rows * width)
        groups, real = [], core.engine.decode._prefill_groups
        monkeypatch.setattr(core.engine.decode, "_prefill_groups", lambda *a: groups.append(a[5]) or real(*a))
        grouped = prefill(model, new_cache(model, width + 4), ids, mask, pos)[0]
    assert groups == [rows]
    assert one.std() > 0.1  # logits of this scale: a row mixed up with another would be off by ~one.std()
    torch.testing.assert_close(grouped, one, rtol=1e-4, atol=1e-4)
    got = generate(model, prompts, 12, stop)
    assert groups == [rows, rows] and [g.tokens for g in got] == want


@pytest.mark.parametrize("check_every", [1, 4, 32])
def test_sampling_draws_as_the_plain_loop_and_leaves_the_generator_where_it_would(tiny, check_every):
    model, prompts = tiny
    free = plain_generate(model, prompts, 16, [], 1.0, torch.Generator(model.device).manual_seed(3))
    stop = stops_at(free, {0: 2, 1: 9, 2: 5, 3: 6})  # every row stops, the last at step 9, between checks
    plain_rng = torch.Generator(model.device).manual_seed(3)
    want = plain_generate(model, prompts, 16, stop, 1.0, plain_rng)
    assert max(len(t) for t in want) == 10 and len({len(t) for t in want}) > 2
    rng = torch.Generator(model.device).manual_seed(3)
    assert [g.tokens for g in generate(model, prompts, 16, stop, Sampling(1.0, rng), check_every=check_every)] == want
    assert torch.equal(rng.get_state(), plain_rng.get_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_writes_the_eager_tokens(tiny):
    _, prompts = tiny
    model, _ = load_target(load_config(ROOT / "configs/tiny-random-llama.yaml"), torch.device("cuda"))
    stop = stops_at(plain_generate(model, prompts, 24, []), {0: 3, 1: 10})
    eager = generate(model, prompts, 24, stop)
    assert [g.tokens for g in generate(model, prompts, 24, stop, run=DecodeRun(graphs=True))] == [g.tokens for g in eager]
    assert [len(g.tokens) for g in eager][:2] == [4, 11]
    rngs = [torch.Generator("cuda").manual_seed(5) for _ in range(2)]
    sampled = [[g.tokens for g in generate(model, prompts, 24, stop, Sampling(1.0, rng), DecodeRun(graphs=graphs))]
               for rng, graphs in zip(rngs, (False, True), strict=True)]
    assert sampled[0] == sampled[1] and torch.equal(rngs[0].get_state(), rngs[1].get_state())


def test_data_gen_compile_changes_how_not_what(tiny_cfg):
    on, off, fused, exact = (load_config(ROOT / "configs/tiny-random-llama.yaml", [f"data_gen.compile={v}"])
                             for v in ("yes", "no", "fused", "exact"))
    assert all(generation_settings(c, "t") == generation_settings(off, "t") for c in (on, fused, exact))
    cpu = torch.device("cpu")
    assert decode_options(off.data_gen, cpu) == decode_options(tiny_cfg.data_gen, cpu) == (False, "")  # auto: CPU
    assert decode_options(fused.data_gen, cpu) == (False, "fused")
    assert decode_options(exact.data_gen, cpu) == (False, "exact")
    assert decode_options(exact.data_gen, torch.device("cuda")) == (True, "exact")
    with pytest.raises(ValueError, match="data_gen.compile"):
        decode_options(on.data_gen, cpu)


def test_fused_decode_steps_run_compiled_and_write_the_plain_loops_tokens(tiny, monkeypatch):
    """data_gen.compile=fused: the step goes through torch.compile. Traced here with aot_eager (the same
    capture and functionalization as inductor, no kernel generation: seconds on a CPU, and the eager
    kernels, so the tokens must be the plain loop's); inductor's speed and rounding are GPU figures
    (bench/bench_generate.py --paths fused)."""
    import torch._dynamo

    model, prompts = tiny
    monkeypatch.setattr(core.engine.decode_step, "FUSE_BACKEND", "aot_eager")
    core.engine.decode_step._fused_forward.cache_clear()
    torch._dynamo.reset()
    stop = stops_at(plain_generate(model, prompts, 12, []), {0: 3})
    want = plain_generate(model, prompts, 12, stop)
    for _ in range(2):  # a second call reuses the compiled step
        assert [g.tokens for g in generate(model, prompts, 12, stop, run=DecodeRun(fuse="fused"))] == want
    assert core.engine.decode_step._fused_forward.cache_info().misses == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # a graph was captured, not skipped


@pytest.mark.parametrize("fuse", ["", "fused"])
def test_a_finished_call_frees_its_cache_at_once(tiny, monkeypatch, fuse):
    """The static cache (24 GB at batch 512 x 2,048 slots on the GPU) is gone when generate returns, without
    Python's cyclic collector: a step that kept itself alive through a bound method of its own left each
    batch's cache to the collector's timing (the likely cause of the H200's out-of-memory a few batches in)."""
    import gc
    import weakref

    import core.engine.decode

    model, prompts = tiny
    monkeypatch.setattr(core.engine.decode_step, "FUSE_BACKEND", "aot_eager")
    made = []

    def recorded(model, length):
        made.append(cache := new_cache(model, length))
        return cache

    monkeypatch.setattr(core.engine.decode, "new_cache", recorded)
    if fuse:  # compiling holds the first call's cache in dynamo's own cyclic garbage: once, not per batch
        generate(model, prompts, 6, [], run=DecodeRun(fuse=fuse))
    gc.collect()
    gc.disable()
    try:
        generate(model, prompts, 6, [], run=DecodeRun(fuse=fuse))
        freed = weakref.ref(made.pop())
        assert freed() is None
    finally:
        gc.enable()


def test_exact_fusion_leaves_what_inductor_rounds_differently_to_aten(monkeypatch):
    """data_gen.compile=exact: no graph handed to the compiler holds a norm's reduction or rsqrt, SiLU, or the
    rotary table's cos/sin (ATen runs them, between the compiled pieces), while RoPE's and the residual's
    elementwise ops are in them; the tokens are the plain loop's. Traced on a fresh tiny target (the patch
    stays on its modules) with a recording backend; that inductor's fused bf16 kernels round as eager does is
    the GPU benchmark's check (bench/bench_generate.py --paths exact exits 1 on any differing row)."""
    import torch._dynamo

    model, _ = load_target(load_config(ROOT / "configs/tiny-random-llama.yaml"))
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = plain_generate(model, prompts, 6, [])
    graphs = []

    def recording(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")})
        return gm.forward

    monkeypatch.setattr(core.engine.decode_step, "FUSE_BACKEND", recording)
    core.engine.decode_step._fused_forward.cache_clear()
    torch._dynamo.reset()
    assert [g.tokens for g in generate(model, prompts, 6, [], run=DecodeRun(fuse="exact"))] == want
    ops = set().union(*graphs)
    for kept_out in ("rsqrt", "mean", "silu", "cos", "sin"):
        assert not [o for o in ops if kept_out in o], kept_out
    assert "<built-in function add>" in ops and "<built-in function neg>" in ops and len(graphs) > 2


def test_exact_fusion_refuses_a_target_with_norms_it_does_not_keep_eager(tiny):
    """A LayerNorm would be fused and round differently: "exact" refuses such a target instead of writing
    tokens that part from the eager loop's."""
    from core.engine.decode_step import DecodeStep, eager_rounding_modules
    from core.run.errors import UserError

    model, prompts = tiny
    assert eager_rounding_modules(model)  # the tiny Llama: RMSNorms only
    model.model.layers[0].extra_norm = torch.nn.LayerNorm(4)
    try:
        with pytest.raises(UserError, match="LayerNorm"):
            DecodeStep(model, None, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), False, "exact")
    finally:
        del model.model.layers[0].extra_norm


def test_the_generation_benchmark_runs_and_compares_every_path_with_eager(tmp_path):
    """bench/bench_generate.py on the tiny target (CPU), run as a user runs it: a path listed before eager is
    still compared with it once every path has run (it used to get None), data_gen's bf16 decode is timed
    against a bound that counts bf16 weights, and the script exits 0 (it exits 1 on a required mismatch)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "gen.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/bench_generate.py"), "--target", "tiny-random-llama",
                           "--device", "cpu", "--batch", "2", "--prompt-len", "8", "--new-tokens", "3", "--paths",
                           "hf", "eager", "bf16", "--repeats", "1", "--bandwidth", "10", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["hf"]["rows_equal_eager"] == 2 and rows["eager"]["rows_equal_eager"] == 2
    assert rows["bf16"]["rows_equal_eager"] is not None and 0 <= rows["bf16"]["rows_equal_eager"] <= 2
    assert rows["bf16"]["tok_s"] > 0 and rows["bf16"]["of_bound"] > 0
    assert rows["bf16"]["bound_s"] < rows["eager"]["bound_s"]  # bf16 weights: half the bytes to read
