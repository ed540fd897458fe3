"""The SGLang extraction plugin (extract/sglang_plugin.py) against the real sglang==0.5.23 source:
hook targets and signatures, registration through the real HookRegistry, the BEFORE hook queueing
the final states through SGLang's _async_d2h, the replacement keeping the original's offset
contract, and its dump behaviour on scripted scheduler batches (stand-in Req /
LogitsProcessorOutput objects with the attributes the real code reads)."""

import ast
import sys
import threading
import tomllib
import types

import pytest
import torch
from safetensors import safe_open

from extract import sglang_plugin as plugin
from tests.conftest import ROOT, holds_for, wait_until
from tests.fake_sglang_server import LogitsOut, Mode, Req
from tests.sglang_source import (
    MANAGERS_UTILS_FILE,
    RESULT_PROCESSOR_FILE,
    load_hook_registry,
    method_signature,
    real_append_prefill_hidden_states,
    sglang_root,
    source_class,
    source_method_text,
)

H = 8


def rows_for(req_id: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Recognisable rows: value = request id * 1000 + position."""
    base = torch.tensor([req_id * 1000 + p for p in positions], dtype=torch.float32)[:, None]
    return base.expand(-1, 3 * H).clone(), (base + 0.5).expand(-1, H).clone()


def test_hook_targets_exist_with_the_expected_signatures():
    pos, kw = method_signature(RESULT_PROCESSOR_FILE, "SchedulerBatchResultProcessor", "_append_prefill_hidden_states")
    assert pos == ["self"] and kw == ["req", "logits_output", "hidden_state_offset", "capture_hidden_mode",
                                      "extend_input_len", "store"]
    pos, kw = method_signature(MANAGERS_UTILS_FILE, "GenerationBatchResult", "copy_to_cpu")
    assert pos == ["self", "return_logprob", "return_hidden_states"] and kw == []
    utils = (sglang_root() / MANAGERS_UTILS_FILE).read_text()
    assert "from sglang.srt.utils.common import async_d2h as _async_d2h" in utils
    assert "def get_parallel()" in (sglang_root() / "srt/runtime_context.py").read_text()
    assert "attn_tp_rank" in (sglang_root() / "srt/runtime_context.py").read_text()
    # targets named as dotted paths resolve to those files
    assert plugin.APPEND_TARGET.replace(".", "/").startswith("sglang/" + RESULT_PROCESSOR_FILE.removesuffix(".py"))
    assert plugin.COPY_TARGET.replace(".", "/").startswith("sglang/" + MANAGERS_UTILS_FILE.removesuffix(".py"))


def test_entry_point_is_declared():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"eagle3_hidden_dump": "extract.sglang_plugin:register"}
    assert "GENERAL_PLUGINS_GROUP = \"sglang.srt.plugins\"" in (sglang_root() / "srt/plugins/__init__.py").read_text()


class QueuedD2H:
    """What the stand-in _async_d2h returns: proof that a tensor went through SGLang's async copy."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


@pytest.fixture
def real_registry(monkeypatch):
    """The real HookRegistry, importable as sglang.srt.plugins.hook_registry, with a stand-in target
    module whose method is the real _append_prefill_hidden_states compiled from source."""

    def copy_to_cpu(self, return_logprob, return_hidden_states=True):
        """Stand-in for GenerationBatchResult.copy_to_cpu (real parameter names) that returns the final
        states it finds, i.e. what the BEFORE hook did to them. Local: apply_hooks rebinds every
        module global that holds a hooked original, so a module-level one would stay wrapped."""
        return self.logits_output.last_hidden_states

    registry = load_hook_registry()
    target_mod = types.ModuleType("sglang.srt.managers.scheduler_components.batch_result_processor")
    target_mod.SchedulerBatchResultProcessor = type("SchedulerBatchResultProcessor", (), {
        "_append_prefill_hidden_states": real_append_prefill_hidden_states()})
    utils_mod = types.ModuleType("sglang.srt.managers.utils")
    utils_mod.GenerationBatchResult = type("GenerationBatchResult", (), {"copy_to_cpu": copy_to_cpu})
    utils_mod._async_d2h = QueuedD2H
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.managers",
                 "sglang.srt.managers.scheduler_components"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        monkeypatch.setitem(sys.modules, name, pkg)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setitem(sys.modules, target_mod.__name__, target_mod)
    monkeypatch.setitem(sys.modules, utils_mod.__name__, utils_mod)
    monkeypatch.setattr(registry.HookRegistry, "_hooks", registry.defaultdict(list))
    monkeypatch.setattr(registry.HookRegistry, "_patched", set())
    monkeypatch.setattr(plugin, "_PLUGIN", None)
    return registry, target_mod.SchedulerBatchResultProcessor


def batch_result(final: torch.Tensor):
    """A GenerationBatchResult of the stand-in module (hooked or not) carrying `final` rows."""
    result = sys.modules["sglang.srt.managers.utils"].GenerationBatchResult()
    result.logits_output = LogitsOut(torch.zeros(final.shape[0], 3 * H), final)
    return result


def test_inert_without_the_env_var(real_registry, monkeypatch):
    registry, _ = real_registry
    monkeypatch.delenv(plugin.ENV_DIR, raising=False)
    assert plugin.register() is False and not registry.HookRegistry._hooks
    registry.HookRegistry.apply_hooks()
    final = rows_for(1, range(3))[1]
    assert batch_result(final).copy_to_cpu(return_logprob=False, return_hidden_states=True) is final


def test_registers_through_the_real_registry_and_keeps_the_offset_contract(real_registry, monkeypatch, tmp_path):
    registry, processor_cls = real_registry
    original = processor_cls._append_prefill_hidden_states
    monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path / "dumps"))
    assert plugin.register(is_writer=lambda: True)
    hooks = registry.HookRegistry._hooks
    assert [(t.name, h) for t, h, _ in hooks[plugin.APPEND_TARGET]] == [("REPLACE", plugin.append_prefill_hidden_states)]
    assert [(t.name, h) for t, h, _ in hooks[plugin.COPY_TARGET]] == [("BEFORE", plugin.copy_final_to_cpu)]
    registry.HookRegistry.apply_hooks()
    replaced = processor_cls._append_prefill_hidden_states
    assert replaced is not original
    # same offsets as the real method, for every kind of row, dumping or not
    aux, final = rows_for(1, range(10))
    out = LogitsOut(aux, final)
    cases = [(Req("a", list(range(4))), 4, True), (Req("b", [1], output_ids=[5]), 1, True),
             (Req("c", list(range(3)), return_hidden_states=False), 3, True), (Req("d", [1, 2]), 2, False)]
    for full in (True, False):
        off_real = off_ours = 0
        for req, n, store in cases:
            req_copy = Req(req.rid, req.origin_input_ids, req.return_hidden_states, list(req.output_ids))
            req_copy.hidden_states = []
            off_real = original(object(), req=req_copy, logits_output=out, hidden_state_offset=off_real,
                                capture_hidden_mode=Mode(full), extend_input_len=n, store=store)
            off_ours = replaced(object(), req=req, logits_output=out, hidden_state_offset=off_ours,
                                capture_hidden_mode=Mode(full), extend_input_len=n, store=store)
            assert off_ours == off_real
    plugin._PLUGIN.close()


def test_before_hook_queues_the_final_states_through_sglangs_async_d2h(real_registry, monkeypatch, tmp_path):
    """The final states are views of CUDA-graph buffers that the next replay overwrites, so the hook
    must hand them to SGLang's _async_d2h before copy_to_cpu runs, and only when hidden states are
    returned. Called with keywords, as SGLang 0.5.23's scheduler does."""
    registry, _ = real_registry
    monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path / "dumps"))
    assert plugin.register(is_writer=lambda: True)
    registry.HookRegistry.apply_hooks()
    final = rows_for(1, range(3))[1]
    result = batch_result(final)
    seen = result.copy_to_cpu(return_logprob=False, return_hidden_states=True)
    assert isinstance(seen, QueuedD2H) and seen.tensor is final  # queued before the original ran
    assert result.logits_output.last_hidden_states is seen
    assert batch_result(final).copy_to_cpu(return_logprob=True, return_hidden_states=False) is final
    assert batch_result(final).copy_to_cpu(True, False) is final
    plugin._PLUGIN.close()


@pytest.fixture
def state(tmp_path, monkeypatch):
    """A writing rank's state, made as the first hook call makes it."""
    loaded = plugin.Plugin(tmp_path / "dumps", 4, lambda: True)
    monkeypatch.setattr(plugin, "_PLUGIN", loaded)
    yield loaded.writer_state()
    loaded.close()


def call(req, out, offset, n, store=True):
    return plugin.append_prefill_hidden_states(object(), req=req, logits_output=out, hidden_state_offset=offset,
                                               capture_hidden_mode=Mode(True), extend_input_len=n, store=store)


def read_dump(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_chunked_prefill_with_decode_rows_warmup_and_health_check(state, caplog):
    """One 9-token prompt prefilled in 3 chunks, each batch also carrying decode rows of another
    request, a warmup request without return_hidden_states and a health check."""
    st = state
    long_req = Req("conv-7/turn 1", list(range(100, 109)))
    chunks = [range(0, 4), range(4, 7), range(7, 9)]
    for k, chunk in enumerate(chunks):
        long_req.inflight_middle_chunks = 1 if k < 2 else 0
        decode = Req("other", [1, 2, 3], output_ids=[9])  # a decode row: 1 row, never dumped
        warmup = Req("warmup", [5, 6], return_hidden_states=False)
        health = Req("HEALTH_CHECK_1", [7], return_hidden_states=False)
        parts = [rows_for(7, chunk), rows_for(2, range(1)), rows_for(3, range(2)), rows_for(4, range(1))]
        out = LogitsOut(torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts]))
        off = call(long_req, out, 0, len(chunk), store=k == 2)  # middle chunks arrive with store=False
        off = call(decode, out, off, 1)
        off = call(warmup, out, off, 2)
        off = call(health, out, off, 1)
        assert off == out.hidden_states.shape[0]
    st.writer.queue.join()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # decode rows were skipped, not rejected
    files = sorted(p.name for p in st.writer.dir.iterdir())
    assert files == [plugin.dump_path(st.writer.dir, "conv-7/turn 1").name]
    assert "/" not in files[0] and files[0].startswith("conv-7_turn_1-")
    tensors, meta = read_dump(st.writer.dir / files[0])
    assert meta["rid"] == "conv-7/turn 1"
    assert tensors["input_ids"].tolist() == list(range(100, 109))
    expect_aux, expect_final = rows_for(7, range(9))
    assert torch.equal(tensors["aux"], expect_aux) and torch.equal(tensors["final"], expect_final)


def test_nothing_wrong_is_written(state):
    st = state
    aux, final = rows_for(1, range(5))
    out = LogitsOut(aux, final)
    call(Req("short", list(range(6))), out, 0, 5)  # 5 rows for a 6-token prompt: row check fails
    aborted = Req("aborted", list(range(5)), inflight_middle_chunks=1)
    call(aborted, out, 0, 3)
    aborted.inflight_middle_chunks = 0
    call(aborted, out, 3, 2, store=False)  # finished/discarded at its last chunk: buffers dropped
    st.writer.queue.join()
    assert [p.name for p in st.writer.dir.iterdir()] == [plugin.failure_path(st.writer.dir, "short").name]
    assert "5 aux / 5 final rows for 6 prompt tokens" in plugin.failure_path(st.writer.dir, "short").read_text()
    assert len(st.stitcher) == 0


def test_sanitized_rids_stay_inside_the_dump_dir_and_never_collide(tmp_path):
    names = {plugin.sanitize_rid(r) for r in ["../../etc/passwd", "a/b", "a_b", "", ".hidden", "x" * 500, "ok-1.2"]}
    assert len(names) == 7 and "ok-1.2" in names
    for r in ["../../etc/passwd", "", ".hidden", "x" * 500]:
        p = plugin.dump_path(tmp_path, r)
        assert p.parent == tmp_path and not p.name.startswith(".") and len(p.name) < 140


def test_full_queue_blocks_the_scheduler_until_the_disk_catches_up(tmp_path, monkeypatch):
    """Backpressure: with the writer stalled, the put of the (max_pending+2)-th dump blocks."""
    gate, writing = threading.Event(), threading.Event()
    real_save = plugin.save_file

    def stalled_save(*args, **kwargs):
        writing.set()
        gate.wait()
        real_save(*args, **kwargs)

    monkeypatch.setattr(plugin, "save_file", stalled_save)
    writer = plugin.DumpWriter(tmp_path, max_pending=2)
    aux, final = rows_for(1, range(3))
    done = []

    def produce():
        for i in range(4):  # 1 being written + 2 queued, then the 4th put must wait
            writer.put(f"r{i}", [1, 2, 3], aux, final)
            done.append(i)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    wait_until(lambda: len(done) >= 3 and writing.is_set(), "3 puts with the writer stalled on the 1st dump")
    holds_for(lambda: done == [0, 1, 2] and writer.queue.full() and t.is_alive(), "the 4th put blocks", 0.5)
    gate.set()
    wait_until(lambda: done == [0, 1, 2, 3], "the 4th put once the disk catches up")
    t.join()
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r{i}.safetensors" for i in range(4)]


# ----------------------------------------------------------------------------- ranks, aborts, failures
@pytest.fixture
def scheduler_process(real_registry, monkeypatch, tmp_path):
    """register() as SGLang's load_plugins() runs it in a scheduler process, before that process's
    ranks are published; `publish(attn_tp_rank, attn_cp_rank)` then publishes them through a stand-in
    sglang.srt.runtime_context.get_parallel. Yields (publish, hooked processor class, dump dir)."""
    registry, processor_cls = real_registry
    parallel = types.SimpleNamespace()
    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = lambda: parallel
    monkeypatch.setitem(sys.modules, runtime.__name__, runtime)
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(plugin.ENV_DIR, str(dump_dir))
    assert plugin.register()
    registry.HookRegistry.apply_hooks()
    yield (lambda tp, cp: vars(parallel).update(attn_tp_rank=tp, attn_cp_rank=cp)), processor_cls, dump_dir
    plugin._PLUGIN.close()


def prefill(processor_cls, req, chunks, finished_at=None, stop_after=None):
    """Feed `req`'s prompt rows to the hooked method in `chunks` (row ranges), as SGLang's result
    processor does; from chunk `finished_at` on the request is aborted (finished, store=False); after
    `stop_after` chunks nothing more comes."""
    for k, chunk in enumerate(chunks[:stop_after]):
        last = k == len(chunks) - 1
        req.inflight_middle_chunks = 0 if last else 1
        if k == finished_at:
            req.finished_reason = {"type": "abort"}
        aux, final = rows_for(7, chunk)
        processor_cls._append_prefill_hidden_states(
            object(), req=req, logits_output=LogitsOut(aux, final), hidden_state_offset=0,
            capture_hidden_mode=Mode(True), extend_input_len=len(chunk), store=last and not req.finished())


def test_abort_between_chunks_frees_the_chunks_and_a_rerun_gets_a_whole_dump(scheduler_process):
    """SGLang aborts a chunked prefill between chunks (scheduler.process_pending_chunked_abort); the chunk
    already launched lands finished under the overlap scheduler, or never comes back without it. Its
    buffered chunks must go either way, and the rerun of the same rid must not see them."""
    publish, processor_cls, dump_dir = scheduler_process
    publish(0, 0)
    chunks = [range(0, 4), range(4, 7), range(7, 10)]
    prefill(processor_cls, Req("rid-1", list(range(10))), chunks, finished_at=1)  # overlap: lands finished
    dropped = Req("rid-1", list(range(10)))
    prefill(processor_cls, dropped, chunks, stop_after=1)  # no overlap: the scheduler just drops the Req
    rerun = Req("rid-1", list(range(10)))
    prefill(processor_cls, rerun, chunks)
    path = plugin.dump_path(dump_dir, "rid-1")
    wait_until(path.exists, "the rerun's dump")
    tensors, _ = read_dump(path)
    assert torch.equal(tensors["aux"], rows_for(7, range(10))[0])
    del dropped
    assert len(plugin._PLUGIN.state.stitcher) == 0  # nothing left in the scheduler's memory
    assert not plugin.failure_path(dump_dir, "rid-1").exists()


def test_only_the_attention_group_leader_copies_and_writes(scheduler_process):
    """SGLang's leader is attn_tp_rank == 0 and attn_cp_rank == 0 (request_receiver.py); with
    --attn-cp-size 2 both CP ranks see the request, and a second writer would leave an orphan."""
    publish, processor_cls, dump_dir = scheduler_process
    publish(0, 1)  # attention-CP rank 1 of the group
    prefill(processor_cls, Req("cp", list(range(4))), [range(0, 4)])
    final = rows_for(1, range(3))[1]
    assert batch_result(final).copy_to_cpu(return_logprob=False, return_hidden_states=True) is final
    holds_for(lambda: not dump_dir.exists(), "a non-leader rank writes nothing", 0.3)
    assert not [t for t in threading.enumerate() if t.name == "eagle3-dump-writer"]


def test_register_starts_nothing_outside_a_writing_rank(real_registry, monkeypatch, tmp_path):
    """SGLang loads plugins in its HTTP server, detokenizer and DP controller too, and in a scheduler
    before its ranks are published (scheduler.run_scheduler_process): register() may only record hooks."""
    registry, _ = real_registry

    def unpublished():
        raise RuntimeError("parallel name 'attn_tp_rank' has not been written in this process")

    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = unpublished
    monkeypatch.setitem(sys.modules, runtime.__name__, runtime)
    monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path / "dumps"))
    before = {t for t in threading.enumerate() if t.name == "eagle3-dump-writer"}
    assert plugin.register()
    registry.HookRegistry.apply_hooks()
    assert {t for t in threading.enumerate() if t.name == "eagle3-dump-writer"} == before
    assert not (tmp_path / "dumps").exists()


def hooked_call(processor_cls, req, out, n):
    return processor_cls._append_prefill_hidden_states(object(), req=req, logits_output=out, hidden_state_offset=0,
                                                       capture_hidden_mode=Mode(True), extend_input_len=n)


def test_missing_or_misaligned_final_states_are_reported_not_raised(scheduler_process):
    """Without --enable-return-aux-hidden-states SGLang keeps no last_hidden_states (logits_processor.py):
    the hook must keep the scheduler alive and say why there is no dump."""
    publish, processor_cls, dump_dir = scheduler_process
    publish(0, 0)
    aux, final = rows_for(1, range(5))
    assert hooked_call(processor_cls, Req("no-final", list(range(5))), LogitsOut(aux, None), 5) == 5
    assert hooked_call(processor_cls, Req("short-final", list(range(5))), LogitsOut(aux, final[:4]), 5) == 5
    for name in ("no-final", "short-final"):
        failed = plugin.failure_path(dump_dir, name)
        wait_until(failed.exists, f"the failure file of {name}")
        assert "--enable-return-aux-hidden-states" in failed.read_text()
    assert sorted(p.name for p in dump_dir.iterdir()) == ["no-final.failed", "short-final.failed"]


def test_a_dump_that_fails_to_write_leaves_its_reason(scheduler_process, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    publish, processor_cls, dump_dir = scheduler_process
    publish(0, 0)
    monkeypatch.setattr(plugin, "save_file", full_disk)
    aux, final = rows_for(1, range(3))
    hooked_call(processor_cls, Req("lost", [1, 2, 3]), LogitsOut(aux, final), 3)
    failed = dump_dir / "lost.failed"  # the name the client looks for
    wait_until(failed.exists, "the failure file of the lost dump")
    assert "No space left on device" in failed.read_text()
    assert [p.name for p in dump_dir.iterdir()] == ["lost.failed"]


def test_sglang_facts_the_plugin_and_client_rely_on():
    """Each line pins one behaviour of the real 0.5.23 source that a fix for issue 12 builds on."""
    src = sglang_root()
    receiver = (src / "srt/managers/scheduler_components/request_receiver.py").read_text()
    assert receiver.count("get_parallel().attn_tp_rank == 0 and get_parallel().attn_cp_rank == 0") >= 2
    assert '"attn_cp_rank": (tp_rank // attn_tp_size) % attn_cp_size' in (src / "srt/runtime_context.py").read_text()
    # the rank is published after plugins load, so register() cannot ask it
    sched = source_method_text("srt/managers/scheduler.py", None, "run_scheduler_process")
    assert -1 < sched.index("load_plugins()") < sched.index("publish(")
    # rids are aborted by prefix, so ours must be prefix-free
    abort = source_method_text("srt/managers/scheduler.py", "Scheduler", "abort_request")
    assert "req.rid.startswith(recv_req.rid)" in abort and "chunked_req.rid.startswith(recv_req.rid)" in abort
    # an abort between chunks finishes the Req; a Req hashes and weak-references by identity
    assert "req.finished_reason = FINISH_ABORT(" in (src / "srt/disaggregation/utils.py").read_text()
    finished = source_method_text("srt/managers/schedule_batch.py", "Req", "finished")
    assert "return self.finished_reason is not None" in finished
    for f, cls in (("srt/managers/schedule_batch.py", "Req"), ("srt/dllm/mixin/req.py", "ReqDllmMixin")):
        names = {getattr(n, "name", None) for n in source_class(f, cls).body} | {
            t.id for n in source_class(f, cls).body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)}
        assert not names & {"__eq__", "__hash__", "__slots__"}, (cls, names & {"__eq__", "__hash__", "__slots__"})
    # without aux capture there are no final states to dump
    logits = (src / "srt/layers/logits_processor.py").read_text()
    assert "self.keep_last_hidden_states = features.aux_hidden_state_capture is not None" in logits
    # plugin errors are logged and swallowed; SGLANG_PLUGINS filters by entry-point name
    plugins = source_method_text("srt/plugins/__init__.py", None, "load_plugins")
    assert 'logger.exception("Failed to execute general plugin: %s", name)' in plugins
    assert "ep.name not in allowed_set" in (src / "srt/plugins/__init__.py").read_text()
    # a non-streamed abort without an error status answers normally, with finish_reason type "abort"
    assert 'finish_reason.get("type") != "abort"' in (src / "srt/managers/tokenizer_manager.py").read_text()
