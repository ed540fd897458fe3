"""extract's `sglang` engine end to end through tests/fake_sglang_server.py (a TEST DOUBLE of SGLang's
/generate built on the hf engine and the plugin's real hook): rows equal the hf engine's, cache hits
are caught, kill -9 resumes exactly, an over-budget dump dir pauses sending; plus the launcher's
layer ids checked against the real SGLang source."""

import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from core.aux_layers import resolve_aux_layers
from core.config import load_config
from core.hidden_shards import HiddenShards
from core.target import load_target, target_info
from tests.conftest import ROOT, run_cli
from tests.fake_sglang_server import FakeSGLangServer
from tests.sglang_source import sglang_capture_layers

TINY = "configs/tiny-random-llama.yaml"


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """24 tiny-target conversations and their hf-engine shards (fp32, the reference rows)."""
    base = tmp_path_factory.mktemp("sg")
    run_cli("data_gen", "--config", TINY, "--run-dir", str(base / "hf"), "data_gen.num_samples=24")
    run_cli("extract", "--config", TINY, "--run-dir", str(base / "hf"), "extract.dtype=float32")
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
            "extract.dtype=float32", "extract.max_inflight=4", "extract.request_timeout=60", *extra]


def assert_rows_equal_hf(run, reference):
    ours, ref = HiddenShards(run / "hidden"), HiddenShards(reference / "hf/hidden")
    assert sorted(ours.ids) == sorted(ref.ids)
    for sid in ref.ids:
        a, b = ours.load(sid), ref.load(sid)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["aux"], b["aux"], rtol=1e-4, atol=1e-4)  # hf ran them batched
        torch.testing.assert_close(a["final"], b["final"], rtol=1e-4, atol=1e-4)


def test_rows_equal_hf_engine_and_a_cache_hit_is_reported_not_written(served, conversations):
    run, model, aux = served
    victim = "eagle3-" + HiddenShards(conversations / "hf/hidden").ids[5]
    with FakeSGLangServer(model, aux, run / "dumps", cache_hit_rids=[victim]) as server:
        proc = run_cli("extract", *sglang_flags(run, server.url), check=False)
        assert proc.returncode == 1
        assert "cached_tokens = 3: prefix-cache hit" in proc.stderr and victim.removeprefix("eagle3-") in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("extract: error: 1 samples failed their checks")
        assert len(HiddenShards(run / "hidden")) == 23  # everything else committed, the victim absent
        run_cli("extract", *sglang_flags(run, server.url))  # the rerun fetches just the victim
        assert len(server.request_times) == 24 + 1 and server.health_checks == 2  # one readiness check per run
    assert_rows_equal_hf(run, conversations)
    assert list((run / "dumps").iterdir()) == []  # every dump consumed


def test_kill9_client_then_rerun(served, conversations):
    run, model, aux = served
    with FakeSGLangServer(model, aux, run / "dumps") as server:
        args = [sys.executable, "-m", "extract", *sglang_flags(run, server.url, "extract.shard_mb=0",
                                                                "extract.max_inflight=1")]
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        index = run / "hidden/index.jsonl"
        deadline = time.time() + 120
        while not (index.exists() and len(index.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert 6 <= len(HiddenShards(run / "hidden")) < 24
        run_cli("extract", *sglang_flags(run, server.url))
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
        time.sleep(1.0)
        assert not server.request_times  # ... and sends nothing while the dir is over budget
        freed = time.monotonic()
        (dumps / "someone-elses.bin").unlink()
        rest = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, rest[-2000:]
        assert len(server.request_times) == 24 and min(server.request_times) >= freed
    assert_rows_equal_hf(run, conversations)


@pytest.mark.parametrize("config, source", [("configs/smollm2-135m-instruct.yaml", "llama.py")])
def test_launcher_ids_make_sglang_capture_the_configured_layers(config, source):
    out = subprocess.run([sys.executable, "-m", "extract.sglang_launch", "--config", config], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines())
    ids = [int(i) for i in env["LAYER_IDS"].strip("'").split()]
    cfg = load_config(ROOT / config)
    n = target_info(cfg).num_layers
    assert sglang_capture_layers(source, ids, n) == resolve_aux_layers(cfg.extract.aux_layers, n) == [2, 15, 27]
    script = (ROOT / "scripts/launch_sglang_extract.sh").read_text()
    for flag in ("--enable-return-aux-hidden-states", "--speculative-algorithm EAGLE3", "--disable-radix-cache",
                 "--return-aux-hidden-state-layer-ids $LAYER_IDS", "EAGLE3_DUMP_DIR="):
        assert flag in script
