"""The sglang engine's client (extract/sglang_client.py) in-process against tests/fake_sglang_server.py
(a TEST DOUBLE of SGLang's /generate built on the hf engine and the plugin's real hooks), with small
deadlines: it proves the plugin live before sending samples, never waits forever, removes only its
own orphans, keeps rids prefix-free, reports a lost or aborted dump at once, and stops on a bug."""

import asyncio
import os
import time

import pytest
import torch

from core.run.config import load_config
from core.run.errors import UserError
from core.target.aux_layers import resolve_aux_layers
from core.target.model import load_target, target_info
from extract import sglang_plugin as plugin
from extract.sglang_client import SGLangExtractor
from tests.conftest import ROOT
from tests.fake_sglang_server import FakeSGLangServer

TINY = "configs/tiny-random-llama.yaml"


@pytest.fixture(scope="module")
def target():
    cfg = load_config(ROOT / TINY)
    model, _ = load_target(cfg)
    return model, resolve_aux_layers(cfg.extract.aux_layers, target_info(cfg).num_layers)


def samples(ids: list[str], length: int = 9) -> list[tuple[str, list[int], None]]:
    g = torch.Generator().manual_seed(0)
    return [(sid, torch.randint(5, 1000, (length,), generator=g).tolist(), None) for sid in ids]


def extract(url, dump_dir, todo, *, budget=2**30, dump_timeout=5.0, max_inflight=2, on_result=None):
    """Run the client over `todo`; (client, {sample id: token ids seen}). A hang fails after 20 s."""
    client = SGLangExtractor(url, dump_dir, max_inflight, budget, request_timeout=10, dump_timeout=dump_timeout)
    got = {}

    def keep(sid, extra, ids, aux, final):
        assert aux.shape[0] == final.shape[0] == ids.shape[0]
        got[sid] = ids.tolist()

    asyncio.run(asyncio.wait_for(client.run(todo, on_result or keep), 20))
    return client, got


def test_orphans_and_dead_temps_never_stall_the_budget(target, tmp_path):
    """Hole 1: a dump landing after the client gave up, a killed run's dump and a temp whose writer
    died all count against the budget; the client removes them (only them) instead of waiting forever."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dead_temp = dumps / ".eagle3-0badc0de-000000000000000000000000.safetensors.tmp4242"
    dead_temp.write_bytes(b"\0" * 4096)
    os.utime(dead_temp, (time.time() - 3600,) * 2)  # its writer died an hour ago
    (dumps / "eagle3-0badc0de-111111111111111111111111.safetensors").write_bytes(b"\0" * 4096)
    todo = samples([f"conv-{i}" for i in range(5)])
    with FakeSGLangServer(*target, dumps, deferred_prompts=[todo[0][1]]) as server:
        client, got = extract(server.url, dumps, todo, budget=1, dump_timeout=1.0, max_inflight=1)
    assert sorted(got) == sorted(sid for sid, _, _ in todo[1:])
    assert client.failures == {"DumpMismatch": 1}
    assert list(dumps.iterdir()) == []


def test_the_budget_wait_has_a_deadline_naming_the_rid(target, tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "someone-elses.bin").write_bytes(b"\0" * 4096)
    with FakeSGLangServer(*target, dumps) as server, pytest.raises(UserError) as err:
        extract(server.url, dumps, samples(["a"]), budget=1024, dump_timeout=0.3)
    assert "rid eagle3-" in str(err.value) and "to fall below its 0 MB budget" in str(err.value)
    assert (dumps / "someone-elses.bin").exists()  # not ours: left alone


def test_an_abort_between_chunks_fails_the_sample_at_once_and_a_rerun_extracts_it(target, tmp_path):
    """Hole 2 through the double: the server aborts the request after its first chunk."""
    todo = samples(["x", "y"], length=12)
    with FakeSGLangServer(*target, tmp_path / "dumps", abort_prompts=[todo[0][1]]) as server:
        start = time.monotonic()
        client, got = extract(server.url, tmp_path / "dumps", todo, dump_timeout=5.0)
        assert time.monotonic() - start < 4 and client.failures == {"DumpMismatch": 1} and list(got) == ["y"]
        assert len(server.plugin.state.stitcher) == 0
        _, got = extract(server.url, tmp_path / "dumps", todo[:1])
    assert got == {"x": todo[0][1]}


def test_a_server_without_the_plugin_is_refused_before_any_sample(target, tmp_path):
    """Hole 5: SGLang answers normally when the plugin failed to load, was left out of SGLANG_PLUGINS or
    never runs (--disaggregation-mode prefill); the probe must say so instead of every sample timing out."""
    with FakeSGLangServer(*target, tmp_path / "dumps", plugin_loaded=False) as server, \
            pytest.raises(UserError) as err:
        extract(server.url, tmp_path / "dumps", samples(["a", "b"]), dump_timeout=1.0)
    assert "SGLANG_PLUGINS" in str(err.value) and "probe" in str(err.value)
    assert len(server.rids) == 1  # the probe only


def test_a_server_without_aux_capture_is_refused_with_the_reason(target, tmp_path):
    """Hole 7 through the double: the plugin's failure file reaches the user via the probe."""
    with FakeSGLangServer(*target, tmp_path / "dumps", aux_capture=False) as server, \
            pytest.raises(UserError) as err:
        extract(server.url, tmp_path / "dumps", samples(["a"]), dump_timeout=5.0)
    assert "--enable-return-aux-hidden-states" in str(err.value)


def test_rids_are_fixed_length_and_prefix_free(target, tmp_path):
    """Hole 6: SGLang aborts every request whose rid starts with an aborted rid (scheduler.abort_request)."""
    todo = samples(["s#1", "s#10", "s#100"])
    with FakeSGLangServer(*target, tmp_path / "dumps") as server:
        _, got = extract(server.url, tmp_path / "dumps", todo)
    assert sorted(got) == ["s#1", "s#10", "s#100"]
    rids = server.rids
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    assert len({len(r) for r in rids}) == 1 and len(rids) == 4  # the probe and the samples


def test_a_lost_dump_is_reported_at_once_and_a_bug_stops_the_run(target, tmp_path, monkeypatch):
    """Hole 9: the plugin's reason for a dump it could not write comes back within the sample, not after
    the dump timeout; an error of our own code (not a sample check) is not counted as a failed sample."""
    real_save = plugin.save_file
    todo = samples(["a", "b"])

    def disk_full_for_a(tensors, path, metadata):
        if tensors["input_ids"].tolist() == todo[0][1]:
            raise OSError(28, "No space left on device")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(plugin, "save_file", disk_full_for_a)
    with FakeSGLangServer(*target, tmp_path / "dumps") as server:
        start = time.monotonic()
        client, got = extract(server.url, tmp_path / "dumps", todo, dump_timeout=5.0)
        assert time.monotonic() - start < 4 and list(got) == ["b"] and client.failures == {"DumpMismatch": 1}

        def buggy(sid, extra, ids, aux, final):
            raise ValueError(f"sample {sid!r} written twice")

        with pytest.raises(ValueError, match="written twice"):
            extract(server.url, tmp_path / "dumps", samples(["c"], length=7), on_result=buggy)


def test_the_orphan_sweep_survives_files_renamed_or_consumed_under_it(tmp_path, monkeypatch):
    """Hole 4's race on the sweep's path: the server renames its temp into place, or a worker consumes
    a dump, between the listing and the stat/unlink."""
    from pathlib import Path

    client = SGLangExtractor("http://127.0.0.1:9", tmp_path, 1, 1, request_timeout=1, dump_timeout=1)
    ghosts = [tmp_path / ".eagle3-0badc0de-000000000000000000000000.safetensors.tmp7",
              tmp_path / "eagle3-0badc0de-000000000000000000000000.safetensors"]
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(ghosts))
    assert client.clear_stale_dumps() == 0
