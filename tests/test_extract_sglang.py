"""extract's `sglang` engine end to end through tests/fake_sglang_server.py (a TEST DOUBLE of SGLang's
/generate built on the hf engine and the plugin's real hook): rows equal the hf engine's, cache hits
are caught, kill -9 resumes exactly, an over-budget dump dir pauses sending; plus the launcher's
layer ids checked against the real SGLang source."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.run.config import load_config
from core.storage.hidden_shards import HiddenShards
from core.target.aux_layers import resolve_aux_layers
from core.target.model import load_target, target_info
from tests.conftest import ROOT, holds_for, kill9_after_rows, run_stage, trained_next
from tests.fake_sglang_server import FakeSGLangServer
from tests.sglang_source import sglang_capture_layers, sglang_root

TINY = "configs/tiny-random-llama.yaml"


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """24 tiny-target conversations and their hf-engine shards (fp32, the reference rows)."""
    base = tmp_path_factory.mktemp("sg")
    run_stage("data_gen", "--config", TINY, "--run-dir", str(base / "hf"), "data_gen.num_samples=24")
    run_stage("extract", "--config", TINY, "--run-dir", str(base / "hf"), "extract.dtype=fp32")
    return base


@pytest.fixture
def served(conversations, tmp_path):
    """A fresh run dir holding the conversations, and a model + aux layers for the double."""
    run = tmp_path / "run"
    shutil.copytree(conversations / "hf/conversations", run / "conversations")
    cfg = load_config(ROOT / TINY, [f"run_dir={run}"])
    model, _ = load_target(cfg)
    aux = resolve_aux_layers(cfg.extract.aux_layers, target_info(cfg).num_layers)
    return run, model, aux


def sglang_flags(run, url, *extra):
    return ["--config", TINY, "--run-dir", str(run), "extract.engine=sglang", f"extract.server_url={url}",
            "extract.dtype=fp32", "extract.max_inflight=4", "extract.request_timeout=60", *extra]


def assert_rows_equal_hf(run, reference):
    ours, ref = HiddenShards(run / "hidden"), HiddenShards(reference / "hf/hidden")
    assert sorted(ours.ids) == sorted(ref.ids)
    for sid in ref.ids:
        a, b = ours.load(sid), ref.load(sid)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        # hf ran them batched (other matmul blocking): 1e-3, as the golden test; a wrong row is off by O(1)
        torch.testing.assert_close(a["aux"], b["aux"], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(a["final"], b["final"], rtol=1e-3, atol=1e-3)


def test_rows_equal_hf_engine_and_mismatches_are_reported_not_written(served, conversations):
    run, model, aux = served
    ref = HiddenShards(conversations / "hf/hidden")
    ids = ref.ids
    hit, wrong = (ref.load(ids[i])["input_ids"].tolist() for i in (5, 9))
    with FakeSGLangServer(model, aux, run / "dumps", cache_hit_prompts=[hit], wrong_rows_prompts=[wrong]) as server:
        proc = run_stage("extract", *sglang_flags(run, server.url), check=False)
        assert proc.returncode == 1
        assert "cached_tokens = 3: prefix-cache hit" in proc.stderr and ids[5] in proc.stderr
        assert f"sample {ids[9]!r}: the engine's token ids differ from the sample's" in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("extract: error: 2 samples failed their checks")
        assert len(HiddenShards(run / "hidden")) == 22  # everything else committed, the victims absent
        run_stage("extract", *sglang_flags(run, server.url))  # the rerun fetches just the victims
        # per run one readiness check and one probe request
        assert len(server.request_times) == 24 + 2 + 2 and server.health_checks == 2
    assert_rows_equal_hf(run, conversations)
    assert list((run / "dumps").iterdir()) == []  # every dump consumed


def test_kill9_client_then_rerun(served, conversations):
    run, model, aux = served
    with FakeSGLangServer(model, aux, run / "dumps") as server:
        kill9_after_rows(["-m", "extract", "--engine", "sglang", "--server", server.url,  # the CLI flags
                          *sglang_flags(run, "unused", "extract.engine=hf", "extract.shard_mb=0", "extract.max_inflight=1")],
                         run / "hidden/index.jsonl", 6)
        assert 6 <= len(HiddenShards(run / "hidden")) < 24
        run_stage("extract", *sglang_flags(run, server.url))
    ids = [line for line in (run / "hidden/index.jsonl").read_text().splitlines()]
    assert len(ids) == 24 == len(HiddenShards(run / "hidden"))  # no duplicate index rows
    assert_rows_equal_hf(run, conversations)


def test_dump_dir_over_budget_pauses_sending(served, conversations):
    run, model, aux = served
    dumps = run / "dumps"
    dumps.mkdir(parents=True)
    (dumps / "someone-elses.bin").write_bytes(b"\0" * (3 * 2**20))  # fills the 2 MB budget
    with FakeSGLangServer(model, aux, dumps) as server:
        proc = subprocess.Popen([sys.executable, "-m", "extract", *sglang_flags(run, server.url,
                                 "extract.dump_budget_mb=2")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:  # the client says it is waiting ...
            if "over its 2 MB budget: pausing new requests" in line:
                break
        # ... and sends nothing but its probe while the dir is over budget
        holds_for(lambda: len(server.request_times) == 1, "no sample request while the dump dir is over budget", 1.0)
        freed = time.monotonic()
        (dumps / "someone-elses.bin").unlink()
        rest = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, rest[-2000:]
        assert len(server.request_times) == 1 + 24 and min(server.request_times[1:]) >= freed
    assert_rows_equal_hf(run, conversations)


@pytest.mark.parametrize("config, source", [("configs/smollm2-135m-instruct.yaml", "llama.py")])
def test_launcher_ids_make_sglang_capture_the_configured_layers(config, source):
    out = run_stage("extract.sglang_launch", "--config", config).stdout
    env = dict(line.split("=", 1) for line in out.splitlines())
    ids = [int(i) for i in env["LAYER_IDS"].strip("'").split()]
    cfg = load_config(ROOT / config)
    n = target_info(cfg).num_layers
    assert sglang_capture_layers(source, ids, n) == resolve_aux_layers(cfg.extract.aux_layers, n) == [2, 15, 27]
    script = (ROOT / "scripts/launch_sglang_extract.sh").read_text()
    for flag in ("--enable-return-aux-hidden-states", "--speculative-algorithm EAGLE3", "--disable-radix-cache",
                 "--return-aux-hidden-state-layer-ids $LAYER_IDS", "EAGLE3_DUMP_DIR="):
        assert flag in script


def test_fp8_loss_span_shards_through_the_double_train_and_stats(served, conversations):
    """The same writer behind the sglang engine: fp8 rows within e4m3 precision of the hf engine's fp32
    rows, final only on loss spans; train reads them; stats reports the bytes."""
    run, model, aux = served
    with FakeSGLangServer(model, aux, run / "dumps") as server:
        run_stage("extract", *sglang_flags(run, server.url, "extract.dtype=fp8_e4m3", "extract.spans=loss"))
    ours, ref = HiddenShards(run / "hidden"), HiddenShards(conversations / "hf/hidden")
    assert sorted(ours.ids) == sorted(ref.ids)
    for sid in ref.ids:
        a, b = ours.load(sid), ref.load(sid)
        need = torch.tensor(trained_next(b["loss_mask"].tolist()))
        for got, want in ((a["aux"], b["aux"]), (a["final"][need], b["final"][need])):
            assert ((got - want).abs() <= 2**-4 * want.abs() + 1e-3 * want.abs().amax()).all()
        assert not a["final"][~need].any()
    flags = ["--config", TINY, "--run-dir", str(run), "train.epochs=1", "train.wandb_mode=disabled"]
    bad = run_stage("train", *flags, "train.loss_on_prompt=true", check=False)
    assert bad.returncode == 1 and "extract.spans=loss" in bad.stderr.strip().splitlines()[-1]
    run_stage("train", *flags)
    assert (run / "drafter/model.safetensors").is_file()
    out = run_stage("extract", "stats", "--config", TINY, "--run-dir", str(run)).stdout
    files = sum(p.stat().st_size for p in (run / "hidden").glob("shard-*.safetensors"))
    assert f"bytes/token    {files / ours.num_tokens():,.1f} = aux " in out
    h = target_info(load_config(ROOT / TINY)).hidden_size
    ratio = float(out.split(f"(8H+5  = {8 * h + 5:,} B/token): ")[1].split("x")[0])
    assert 0.3 < ratio <= 0.55 and "at Kimi-K2.5 (H=7168)" in out


def test_dump_dir_bytes_skips_a_file_renamed_while_it_is_measured(tmp_path, monkeypatch):
    """The server renames `.tmp` dumps into place while the client sums the dir: a listed file that is
    gone by its stat() counts as nothing instead of aborting the whole extraction."""
    from extract.server_extract import dump_dir_bytes

    (tmp_path / "eagle3-a.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    listed = [*tmp_path.iterdir(), tmp_path / ".eagle3-b.safetensors.tmp123"]  # renamed away meanwhile
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(listed))
    real_is_file = Path.is_file  # the ghost was still a file when a checker looked
    monkeypatch.setattr(Path, "is_file", lambda self: self.name.endswith(".tmp123") or real_is_file(self))
    assert dump_dir_bytes(tmp_path) == 100


def test_launcher_refuses_flags_that_break_capture_and_sets_watchdog_and_plugins(tmp_path):
    """The script runs to its `exec python -m sglang.launch_server`, which a recording TEST DOUBLE of
    python (first on PATH, tmp_path only) answers with the arguments and environment it got."""
    from extract.sglang_launch import refused_flags

    shim = tmp_path / "bin/python"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nif [ "$2" = sglang.launch_server ]; then echo "ARGS $*"; '
                    f'echo "PLUGINS $SGLANG_PLUGINS"; exit 0; fi\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "SGLANG_PLUGINS": "other"}
    run = tmp_path / "run"

    def launch(*flags, overrides=()):
        return subprocess.run(["bash", str(ROOT / "scripts/launch_sglang_extract.sh"), TINY, f"run_dir={run}",
                               "extract.request_timeout=100", *overrides, "--", *flags], cwd=ROOT, env=env,
                              capture_output=True, text=True)

    ok = launch("--tp", "2", "--attn-cp-size", "1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "--watchdog-timeout 400 --tp 2" in ok.stdout and "PLUGINS other,eagle3_hidden_dump" in ok.stdout
    assert "--trust-remote-code" not in ok.stdout
    remote = launch("--tp", "2", overrides=["target.trust_remote_code=true"])  # Kimi-K2.5's tokenizer needs it
    assert remote.returncode == 0 and " --trust-remote-code --port " in remote.stdout, remote.stderr[-2000:]
    bad = launch("--allow-auto-truncate")
    assert bad.returncode != 0 and "truncated prompt" in bad.stderr and "ARGS" not in bad.stdout, bad.stderr[-500:]
    for flags, said in ((["--attn-cp-size", "2"], "--attn-cp-size > 1"),
                        (["--disaggregation-mode=prefill"], "never calls the plugin"),
                        (["--enable-hierarchical-cache", "--tp", "2"], "prefix-cache hit"),
                        (["--enable-two-batch-overlap"], "skip aux capture")):
        assert [w for w in refused_flags(flags, "kimi_k2") if said in w], flags
    assert not refused_flags(["--enable-two-batch-overlap", "--attn-cp-size=1", "--disaggregation-mode", "decode"],
                             "llama")


def test_launcher_flags_exist_in_sglang():
    """Every flag the launcher sets or refuses is a 0.5.23 server field (flag = "--" + name with - for _)."""
    fields = "".join(p.read_text() for p in (sglang_root() / "srt/arg_groups/fields").glob("*.py"))
    for name in ("attn_cp_size", "enable_two_batch_overlap", "disaggregation_mode", "allow_auto_truncate",
                 "enable_hierarchical_cache", "disable_radix_cache", "watchdog_timeout", "trust_remote_code"):
        assert f"\n    {name}: " in fields, name
    assert 'return "--" + name.replace("_", "-")' in (sglang_root() / "srt/arg_groups/arg_utils.py").read_text()
    assert "    ] = 300\n" in fields.split("watchdog_timeout: ")[1][:400]  # SGLANG_DEFAULT_WATCHDOG_S
