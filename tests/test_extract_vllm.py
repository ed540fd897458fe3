"""extract's `vllm` engine (stock vLLM 0.33, no patch) end to end through tests/fake_vllm_server.py (a TEST DOUBLE
whose connector steps are vLLM's own code): shards equal the hf engine's bit for bit in fp32, each fault is one
line naming the sample and nothing wrong is written, kill -9 resumes exactly, an over-budget dump dir pauses
sending; plus the contract the double speaks, checked against vLLM's real source (file keys, answer fields,
request ids, lock, the layer-id convention of its Llama and DeepSeek/Kimi models) and the launcher."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from core.run.config import load_config
from core.storage.hidden_shards import HiddenShards
from core.target.model import load_target
from core.target.vllm_extract import AUX_OVER_PP, LAUNCH_FILE, refused_flags, vllm_layer_ids
from extract.vllm_client import VLLMExtractor, final_norm
from tests.conftest import ROOT, holds_for, kill9_after_rows, run_stage
from tests.fake_vllm_server import FakeVLLMServer
from tests.vllm_source import (
    CONNECTOR_FILE,
    DEEPSEEK_FILE,
    LLAMA_FILE,
    VLLM,
    completion_fields,
    connector_file_keys,
    internal_request_id,
    vllm_deepseek_capture,
    vllm_llama_capture,
)

TINY = "configs/tiny-random-llama.yaml"
EXACT = ["extract.dtype=fp32", "extract.mixed_precision=fp32", "extract.batch_tokens=1"]  # one sample a forward


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """24 tiny-target conversations and their hf-engine shards (fp32, one sample per forward: the reference)."""
    base = tmp_path_factory.mktemp("vl")
    run_stage("data_gen", "--config", TINY, "--run-dir", str(base / "hf"), "data_gen.num_samples=24")
    run_stage("extract", "--config", TINY, "--run-dir", str(base / "hf"), *EXACT)
    return base


def launch(config: str, *args: str) -> subprocess.CompletedProcess:
    return run_stage("extract.vllm_launch", "--config", config, *args, check=False)


@pytest.fixture
def served(conversations, tmp_path):
    """A fresh run dir holding the conversations, the launcher's command for it (which also recorded its layer
    ids in the dump dir) and the target for the double."""
    run = tmp_path / "run"
    shutil.copytree(conversations / "hf/conversations", run / "conversations")
    proc = launch(TINY, f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    model, _ = load_target(load_config(ROOT / TINY, [f"run_dir={run}"]))
    return run, proc.stdout.strip(), model


def vllm_flags(run, url, *extra):
    return ["--config", TINY, "--run-dir", str(run), "extract.engine=vllm", f"extract.server_url={url}", *EXACT,
            "extract.max_inflight=4", "extract.request_timeout=30", *extra]


def assert_shards_equal(run, reference):
    ours, ref = HiddenShards(run / "hidden"), HiddenShards(reference / "hidden")
    assert sorted(ours.ids) == sorted(ref.ids)
    for sid in ref.ids:
        a, b = ours.load(sid), ref.load(sid)
        for key in ("input_ids", "loss_mask", "aux", "final"):
            assert torch.equal(a[key], b[key]), (sid, key)


def test_shards_equal_the_hf_engines_and_each_fault_is_named_not_written(served, conversations):
    run, command, model = served
    ref = HiddenShards(conversations / "hf/hidden")
    ids = ref.ids
    prompt = {i: ref.load(ids[i])["input_ids"].tolist() for i in (2, 5, 9, 13, 17)}
    faults = {"no_file": [prompt[2]], "truncated": [prompt[5]], "other_ids": [prompt[9]],
              "other_prompt": [prompt[13]], "no_path": [prompt[17]]}
    with FakeVLLMServer(model, command, **faults) as server:
        proc = run_stage("extract", *vllm_flags(run, server.url), check=False)
        assert proc.returncode == 1
        said = {2: "released cmpl-", 5: "unreadable dump", 9: "the engine's token ids differ from the sample's", 13: "the server ran other token ids",
                17: "no kv_transfer_params.hidden_states_path"}
        for i, what in said.items():
            assert [line for line in proc.stderr.splitlines() if ids[i] in line and what in line], (i, what)
        assert proc.stderr.strip().splitlines()[-1].startswith("extract: error: 5 samples failed their checks")
        assert len(HiddenShards(run / "hidden")) == 19  # everything else committed, the victims absent
        run_stage("extract", *vllm_flags(run, server.url))  # the rerun fetches just the victims
        assert len(server.requests) == (1 + 24) + (1 + 5)  # a probe per run
    assert_shards_equal(run, conversations / "hf")
    assert [p.name for p in (run / "dumps").iterdir()] == [LAUNCH_FILE]  # every file and lock consumed


def test_a_lock_never_released_and_a_server_of_other_layers_are_one_line(served, conversations):
    run, command, model = served
    victim = HiddenShards(conversations / "hf/hidden").ids[3]
    prompt = HiddenShards(conversations / "hf/hidden").load(victim)["input_ids"].tolist()
    with FakeVLLMServer(model, command, locked=[prompt]) as server:
        proc = run_stage("extract", *vllm_flags(run, server.url, "extract.request_timeout=2"), check=False)
    assert proc.returncode == 1 and len(HiddenShards(run / "hidden")) == 23
    assert [line for line in proc.stderr.splitlines() if victim in line and "held the lock of" in line]
    launch_file = run / "dumps" / LAUNCH_FILE
    launch_file.write_text(json.dumps({"layer_ids": [0, 1, 2, 4]}))  # this run needs [1, 2, 3, 4]
    with FakeVLLMServer(model, command) as server:
        proc = run_stage("extract", *vllm_flags(run, server.url), check=False)
        assert server.requests == []  # refused before anything was sent
    assert proc.returncode == 1 and "launched to capture layer ids [0, 1, 2, 4]" in proc.stderr.splitlines()[-1]


def test_kill9_client_then_rerun(served, conversations):
    run, command, model = served
    with FakeVLLMServer(model, command) as server:
        kill9_after_rows(["-m", "extract", "--engine", "vllm", "--server", server.url,  # the CLI flags
                          *vllm_flags(run, "unused", "extract.engine=hf", "extract.shard_mb=0", "extract.max_inflight=1")],
                         run / "hidden/index.jsonl", 6)
        assert 6 <= len(HiddenShards(run / "hidden")) < 24
        run_stage("extract", *vllm_flags(run, server.url))
    assert len((run / "hidden/index.jsonl").read_text().splitlines()) == 24 == len(HiddenShards(run / "hidden"))
    assert_shards_equal(run, conversations / "hf")
    assert [p.name for p in (run / "dumps").iterdir()] == [LAUNCH_FILE]  # the killed run's files removed too


def test_dump_dir_over_budget_pauses_sending(served, conversations):
    run, command, model = served
    (run / "dumps/someone-elses.bin").write_bytes(b"\0" * (3 * 2**20))  # fills the 2 MB budget
    with FakeVLLMServer(model, command) as server:
        proc = subprocess.Popen([sys.executable, "-m", "extract", *vllm_flags(run, server.url,
                                 "extract.dump_budget_mb=2")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            if "over its 2 MB budget: pausing new requests" in line:
                break
        holds_for(lambda: len(server.requests) == 1, "no sample request while the dump dir is over budget", 1.0)
        (run / "dumps/someone-elses.bin").unlink()
        rest = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, rest[-2000:]
        assert len(server.requests) == 1 + 24
    assert_shards_equal(run, conversations / "hf")


# ----------------------------------------------------------------------------- the contract, from vLLM's source
def test_the_double_speaks_vllms_connector_and_answer_contract():
    assert connector_file_keys() == {"hidden_states", "token_ids"}
    fields = completion_fields()
    assert {"id", "kv_transfer_params"} <= fields["response"] and "prompt_token_ids" in fields["choice"]
    rid = VLLMExtractor("http://x", ROOT, 1, 1, 1, dump_timeout=1, layer_ids=[], hidden_size=1,
                        norm_weight=torch.ones(1), norm_eps=1e-5).rid("some sample")
    engine_id = internal_request_id(rid)
    client = VLLMExtractor("http://x", ROOT, 1, 1, 1, dump_timeout=1, layer_ids=[], hidden_size=1,
                           norm_weight=torch.ones(1), norm_eps=1e-5)
    # the connector's default file and lock names (build_connector_meta, wait_for_save) are the client's
    connector = VLLM.text(CONNECTOR_FILE)
    assert 'f"{new_req.req_id}.safetensors"' in connector and 'lock_path = filename + ".lock"' in connector
    assert client.rid_of_file(f"{engine_id}.safetensors") == rid == client.rid_of_file(f"{engine_id}.safetensors.lock")
    assert client.rid_of_file(f"{engine_id}.safetensors.tmp") is None and client.rid_of_file("cmpl-other-0.safetensors") is None
    assert "fcntl.flock(lf, fcntl.LOCK_SH)" in VLLM.method_text(CONNECTOR_FILE, None, "load_hidden_states")


def assert_captures_the_aux_layers_and_final(model, capture) -> None:
    """vLLM's capture loop `capture` over the 6-layer transformers `model`, given vllm_layer_ids([1, 3, 4], 6):
    hidden_states[k] for each aux layer k, and the last layer's output, whose final norm is hidden_states[-1]."""
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    got = capture(model, ids, vllm_layer_ids([1, 3, 4], 6))
    for k, state in zip([1, 3, 4], got, strict=False):
        torch.testing.assert_close(state, hs[k][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_norm(got[3], model.model.norm.weight, model.config.rms_norm_eps), hs[-1][0],
                               atol=1e-5, rtol=1e-5)


def test_vllm_layer_ids_capture_our_aux_layers_and_final_on_llama():
    """vLLM's own Llama capture loop, given vllm_layer_ids, returns hidden_states[k] for each aux layer and the
    last layer's output, whose final norm is the hf engine's `final`."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=6, vocab_size=50)).eval()
    assert_captures_the_aux_layers_and_final(model, vllm_llama_capture)
    assert "supports_aux_hidden_states_over_pp = True" in VLLM.text(LLAMA_FILE) and "llama" in AUX_OVER_PP


def test_vllm_layer_ids_capture_our_aux_layers_and_final_on_deepseek_as_kimi_runs():
    """Kimi-K2.5's language model in vLLM is deepseek_v2.py's: its capture loop takes id k before layer k and
    id L after the last layer, so Kimi's 3/31/59 go as they are. Checked on a small DeepSeek-V3 (MLA + MoE)."""
    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=6,
                           first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                           topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=50)
    model = DeepseekV3ForCausalLM(cfg).eval()
    assert_captures_the_aux_layers_and_final(model, vllm_deepseek_capture)
    # no aux states across pipeline stages in deepseek_v2.py, so -pp > 1 is refused for Kimi
    deepseek_model = VLLM.cls(DEEPSEEK_FILE, "DeepseekV2Model")
    assert "supports_aux_hidden_states_over_pp" not in {getattr(t, "id", None) for n in deepseek_model.body
                                                       if hasattr(n, "targets") for t in n.targets}
    assert "kimi_k2" not in AUX_OVER_PP


def test_launcher_and_dry_run_give_kimis_layer_ids_and_refuse_what_breaks_capture(tmp_path):
    proc = launch("configs/kimi-k2.5.yaml", f"run_dir={tmp_path}", "--", "-tp", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cmd = proc.stdout
    assert cmd.startswith("vllm serve configs/targets/kimi-k2.5 --port 30000 --trust-remote-code ")
    assert '"eagle_aux_hidden_state_layer_ids": [3, 31, 59, 61]' in cmd and cmd.rstrip().endswith("-tp 8")
    assert f'"shared_storage_path": "{tmp_path.resolve()}/dumps"' in cmd
    assert json.loads((tmp_path / "dumps" / LAUNCH_FILE).read_text())["layer_ids"] == [3, 31, 59, 61]
    bad = launch("configs/kimi-k2.5.yaml", f"run_dir={tmp_path}", "--", "-pp", "2")
    assert bad.returncode != 0 and "break hidden-state capture" in bad.stderr and "vllm serve" not in bad.stdout
    for flags in (["--pipeline_parallel_size=2"], ["--speculative-config", "{}"], ["--kv-transfer-config", "{}"]):
        assert refused_flags(flags, "kimi_k2"), flags
    assert refused_flags(["-pp", "2"], "llama") == []  # Llama returns aux states across stages
    dry = run_stage("extract", "--config", "configs/kimi-k2.5.yaml", "--engine", "vllm", "--dry-run", check=False)
    assert dry.returncode == 0 and "vLLM layer ids [3, 31, 59, 61]" in dry.stdout
    assert '"eagle_aux_hidden_state_layer_ids": [3, 31, 59, 61]' in dry.stdout
    assert "57,344 B/token in bf16" in dry.stdout
