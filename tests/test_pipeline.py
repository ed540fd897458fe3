"""All four stages through their CLIs (their `__main__`, in this process: tests/conftest.run_stage) on the
real SmolLM2 target at tiny sizes, then the contracts between them: loss-mask exactness, the aux-layer golden check, the export format, the report."""

import json

import pytest
import torch
from safetensors.torch import load_file

from core.run.config import load_config
from core.storage.atomic_io import FILE_MODE
from core.storage.conversations import read_conversations
from core.storage.hidden_shards import HiddenShards
from core.target.model import load_target
from tests.conftest import ROOT, run_stage
from tests.sglang_source import check_drafter_tensor_names, sglang_capture_layers
from tests.vllm_source import aux_layer_ids, build_vllm_eagle3, check_vllm_load, draft_hf_config, serve_alone

TINY = ["data_gen.num_samples=6", "data_gen.max_new_tokens=24", "data_gen.batch_size=3", "data_gen.part_samples=3",
        "extract.dtype=fp32", "extract.mixed_precision=fp32", "extract.batch_tokens=512",
        "train.epochs=1", "train.ttt_steps=2", "train.batch_size=2", "train.draft_vocab_size=512",
        "train.log_every=1", "eval.max_prompts=2", "eval.max_new_tokens=16", "eval.draft_steps=3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smol") / "run"
    flags = ["--config", "configs/smollm2-135m-instruct.yaml", "--run-dir", str(run_dir), *TINY]
    logs = {stage: run_stage(stage, *flags).stderr for stage in ("data_gen", "extract", "train", "eval")}
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [f"run_dir={run_dir}", *TINY])
    return cfg, run_dir, flags, logs


def test_loss_mask_is_exactly_the_generated_answer(run):
    cfg, run_dir, _, _ = run
    _, tok = load_target(cfg)
    ds = read_conversations(run_dir / "conversations")
    assert len(ds) == 6 and len(set(ds["id"])) == 6
    for row in ds:
        ids, mask = row["input_ids"], row["loss_mask"]
        first, last = mask.index(1), len(mask) - mask[::-1].index(1)
        assert all(mask[first:last]) and not any(mask[:first]) and not any(mask[last:])  # one span
        span = tok.decode(ids[first:last])
        answer = row["messages"][-1]["content"]
        stopped = row["finish_reason"] == "stop"
        assert span == (answer + "<|im_end|>" if stopped else answer)
        assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
        assert tok.decode(ids[last:]) == ("\n" if stopped else "<|im_end|>\n")  # template trailer, not trained on
        assert stopped or sum(mask) == 24


def test_aux_layers_equal_hf_hidden_states(run):
    """Golden: extracted aux for layer i == HF hidden_states[i] == the input of decoder layer i."""
    cfg, run_dir, _, _ = run
    model, _ = load_target(cfg)
    shards = HiddenShards(run_dir / "hidden")
    manifest = json.loads((run_dir / "hidden/manifest.json").read_text())
    layers = manifest["compat"]["aux_layers"]
    assert layers == [2, 15, 27]
    inputs = {}
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda _m, args, kw, i=i: inputs.__setitem__(i, (args[0] if args else kw["hidden_states"]).clone()),
        with_kwargs=True) for i in layers]
    for sid in shards.ids[:3]:
        s = shards.load(sid)
        with torch.no_grad():
            hs = model(s["input_ids"].long()[None], output_hidden_states=True).hidden_states
        h = model.config.hidden_size
        for j, i in enumerate(layers):  # 1e-3: extract ran batched (other matmul blocking); a wrong layer is off by O(1)
            torch.testing.assert_close(s["aux"][:, j * h:(j + 1) * h], hs[i][0], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(hs[i][0], inputs[i][0])
        torch.testing.assert_close(s["final"], hs[-1][0], rtol=1e-3, atol=1e-3)
    for hk in hooks:
        hk.remove()


def test_exported_drafter_loads_in_sglang_and_captures_the_trained_layers(run):
    _, run_dir, _, _ = run
    cfg = json.loads((run_dir / "drafter/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == 49152 and cfg["draft_vocab_size"] == 512 and cfg["hidden_size"] == 576
    assert cfg["rope_theta"] == 100000.0
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_layers("llama.py", ids, 30) == [2, 15, 27]  # what the drafter was trained on
    assert check_drafter_tensor_names(load_file(str(run_dir / "drafter/model.safetensors"))) == []


def test_the_speculators_copy_serves_in_vllm_alone_with_the_trained_layers(run):
    """drafter-speculators/: `vllm serve <dir>` starts SmolLM2 from the Hub with this drafter, which vLLM's real
    readers take with the trained aux layers and load whole (the same weights file as drafter/)."""
    _, run_dir, _, _ = run
    spec_dir = run_dir / "drafter-speculators"
    assert serve_alone(spec_dir) == ("HuggingFaceTB/SmolLM2-135M-Instruct",
                                     {"method": "eagle3", "num_speculative_tokens": 3, "model": str(spec_dir)})
    hf = draft_hf_config(spec_dir)
    assert aux_layer_ids(hf) == {"v2": (2, 15, 27), "v1": (2, 15, 27)}
    model, record = build_vllm_eagle3(hf, 49152, 30)
    assert check_vllm_load(model, record, load_file(str(spec_dir / "model.safetensors"))) == []
    assert (spec_dir / "model.safetensors").read_bytes() == (run_dir / "drafter/model.safetensors").read_bytes()
    assert json.loads((spec_dir / "manifest.json").read_text())["fingerprint"] == json.loads(
        (run_dir / "drafter/manifest.json").read_text())["fingerprint"]


def test_exported_drafter_counts_its_draft_tokens_over_the_trained_answers(run):
    """draft_vocab_counts.json (what `python -m train.prune_vocab` ranks by): per draft index, how often that
    token is trained on in the samples."""
    _, run_dir, _, _ = run
    rec = json.loads((run_dir / "drafter/draft_vocab_counts.json").read_text())
    tensors = load_file(str(run_dir / "drafter/model.safetensors"))
    target_ids = tensors["d2t"] + torch.arange(512)
    shards = HiddenShards(run_dir / "hidden")
    total = torch.zeros(49152, dtype=torch.int64)
    for sid in shards.ids:
        s = shards.load(sid, names=("input_ids", "loss_mask"))
        total += torch.bincount(s["input_ids"][s["loss_mask"].bool()].long(), minlength=49152)
    assert rec["counts"] == total[target_ids].tolist() and sum(rec["counts"]) > 0
    assert rec["target_ids"] == target_ids.tolist()


def test_outputs_are_readable_by_other_users(run):
    """Files get the umask's mode (0644 under 022), not safetensors' 0600: a server running as another
    user must read the drafter, checkpoints, shards and reports."""
    _, run_dir, _, _ = run
    files = [f for d in ("drafter", "train/checkpoints", "hidden", "conversations", "eval")
             for f in (run_dir / d).rglob("*") if f.is_file() and not f.name.startswith(".")]
    assert any(f.name == "model.safetensors" for f in files) and len(files) > 10
    wrong = {str(f.relative_to(run_dir)): oct(f.stat().st_mode & 0o777) for f in files
             if f.stat().st_mode & 0o777 != FILE_MODE}
    assert not wrong, f"expected {oct(FILE_MODE)}: {wrong}"


def test_training_logged_metrics_and_wandb_offline(run):
    _, run_dir, _, _ = run
    rows = [json.loads(x) for x in (run_dir / "train/metrics.jsonl").read_text().splitlines()]
    assert rows and {"loss", "acc_0", "acc_1", "loss_0", "loss_1", "lr"} <= set(rows[-1])
    assert list((run_dir / "train/wandb").glob("offline-run-*"))
    assert (run_dir / "train/curves.png").stat().st_size > 0


def test_report_contract(run):
    _, run_dir, _, _ = run
    r = json.loads((run_dir / "eval/report.json").read_text())
    for key in ("acceptance_length", "per_position_acceptance", "outputs_match_baseline", "tokens_per_s_baseline",
                "tokens_per_s_spec", "speedup", "num_prompts", "draft_steps", "temperature"):
        assert key in r, key
    assert r["outputs_match_baseline"] is True and r["num_prompts"] == 2 and r["draft_steps"] == 3
    assert 1.0 <= r["acceptance_length"] <= 4.0 and len(r["per_position_acceptance"]) == 3
    assert (run_dir / "eval/report.md").read_text().startswith("# EAGLE-3 drafter")
    # held-out prompts, checked against what the drafter trained on (its trained_prompts.json): none of them
    assert r["trained_on_prompts"] == [] and "held-out split of sharegpt: 2% of its prompts by a hash of their text" in r["prompts_split"]
    assert "none of them in the drafter's training data" in (run_dir / "eval/report.md").read_text()
    assert (run_dir / "eval/acceptance.png").stat().st_size > 0
    assert r["config"]["eval"]["draft_steps"] == 3 and len(r["git_sha"].removesuffix("+dirty")) in (40, len("unknown"))


def test_every_output_dir_records_where_it_came_from(run):
    """Each stage's manifest: its settings fingerprint and, downstream, the fingerprint it was made from."""
    _, run_dir, _, _ = run
    m = {d: json.loads((run_dir / d / "manifest.json").read_text())
         for d in ("conversations", "hidden", "train", "drafter", "eval")}
    assert m["hidden"]["settings"]["conversations"] == m["conversations"]["fingerprint"]
    assert m["train"]["settings"]["hidden"] == m["hidden"]["fingerprint"] == m["drafter"]["settings"]["hidden"]
    assert m["eval"]["settings"]["drafter"] == m["drafter"]["fingerprint"]
    assert m["train"]["runtime"]["world_size"] == 1 and m["train"]["runtime"]["torch_threads"] >= 1
    assert all(x["git_sha"] and x["config"]["target"]["model"] == "smollm2-135m-instruct" for x in m.values())


def test_rerun_resumes_without_duplicates(run):
    _, run_dir, flags, _ = run
    before = read_conversations(run_dir / "conversations")["id"]
    log = run_stage("data_gen", *flags).stderr
    assert "0 to generate" in log
    assert sorted(read_conversations(run_dir / "conversations")["id"]) == sorted(before)
    log = run_stage("extract", *flags).stderr
    assert "0 to do" in log and len(HiddenShards(run_dir / "hidden")) == 6


def test_eval_on_mt_bench_prompt_file(run, tmp_path):
    _, run_dir, flags, _ = run
    mt = ROOT / "tests/data/mt_bench_3.jsonl"
    run_stage("eval", *flags, "--prompts", str(mt), "--out", str(tmp_path), "--max-prompts", "1",
            "--max-new-tokens", "8")
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["num_prompts"] == 1 and r["per_prompt"][0]["id"] == "81" and r["outputs_match_baseline"]
