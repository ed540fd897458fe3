"""A run dir that cannot lie (issue 11): each case here once ended in a wrong result with exit 0, or in a
traceback without the file. Every stage runs through its CLI on a copy of the tiny pipeline's run: its
`__main__` in this process (tests/conftest.run_stage), or a real process where processes are the point
(a lock held by another train, torchrun / accelerate launch, a private mount namespace)."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.drafters.drafter import DrafterConfig, Eagle3Drafter
from core.run.errors import UserError
from core.storage.hidden_shards import INDEX
from core.storage.stage_lock import LOCK_FILE
from tests.conftest import ROOT, run_stage, wait_until


@pytest.fixture
def run(overfit_tiny, tmp_path):
    """A private copy of the finished tiny run (data_gen, extract, train done) -> (run_dir, CLI flags)."""
    _, src, flags, _ = overfit_tiny
    dst = tmp_path / "run"
    for stage_dir in ("conversations", "hidden", "train", "drafter"):  # not eval/: another worker may write it
        shutil.copytree(src / stage_dir, dst / stage_dir, ignore=shutil.ignore_patterns(LOCK_FILE))
    return dst, [str(dst) if f == str(src) else f for f in flags]


def one_line_error(proc: subprocess.CompletedProcess, stage: str, *says: str) -> str:
    """The stage failed with exit != 0 and its own one-line message (no traceback) that says `says`."""
    assert proc.returncode != 0, f"{stage} exited 0:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = next(x for x in reversed(proc.stderr.splitlines()) if x.startswith(f"{stage}: error:"))
    for word in says:
        assert word in line, line
    return line


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != LOCK_FILE}


# 1. integrity ------------------------------------------------------------------------------------

def test_flipped_aux_bytes_stop_training_naming_shard_and_sample(run):
    run_dir, flags = run
    drafter_before = files_of(run_dir / "drafter")
    rows = [json.loads(x) for x in (run_dir / "hidden" / INDEX).read_text().splitlines()]
    first = next(r for r in rows if r["shard"] == "shard-00000.safetensors" and r["offset"] == 0)
    path = run_dir / "hidden" / first["shard"]
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + json.loads(data[8:8 + n])["aux"]["data_offsets"][0]
    data[start:start + 64] = b"\xff" * 64  # what the issue did: 64 bytes of one sample's aux
    path.write_bytes(bytes(data))
    proc = run_stage("train", *flags, check=False)
    one_line_error(proc, "train", first["shard"], repr(first["id"]), "aux fails its checksum")
    assert files_of(run_dir / "drafter") == drafter_before


def test_truncated_shard_is_named(run):
    run_dir, flags = run
    path = run_dir / "hidden" / "shard-00000.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    one_line_error(run_stage("train", *flags, check=False), "train", "shard-00000.safetensors", "unreadable shard")


def test_diverging_training_stops_at_the_first_non_finite_loss_and_exports_nothing(run):
    run_dir, flags = run
    proc = run_stage("train", *flags, "--fresh", "train.lr=1e30", "train.epochs=2", check=False)
    line = one_line_error(proc, "train", "non-finite", "at step", "on samples", "shard-")
    assert "nothing was exported" in line
    assert not (run_dir / "drafter").exists()  # --fresh removed the old one; no NaN drafter replaced it


def test_export_refuses_non_finite_weights(tmp_path):
    c = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, vocab_size=64, draft_vocab_size=32, target_hidden_size=16, aux_layers=[1, 2, 3],
                      target_model_type="llama")
    drafter = Eagle3Drafter(c)
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    with pytest.raises(UserError, match="fc.weight has 1 non-finite"):
        drafter.save_pretrained(tmp_path / "drafter")
    assert not (tmp_path / "drafter").exists()
    # a ZeRO-3 rank's own module holds an empty partition of each weight: never exported as the drafter
    drafter = Eagle3Drafter(c)
    drafter.midlayer.mlp.down_proj.weight = torch.nn.Parameter(torch.empty(0))
    with pytest.raises(UserError, match="midlayer.mlp.down_proj.weight is empty"):
        drafter.save_pretrained(tmp_path / "drafter")
    assert not (tmp_path / "drafter").exists()


# 2, 3. provenance -------------------------------------------------------------------------------

def test_train_does_not_resume_across_changed_settings(run):
    run_dir, flags = run
    before = files_of(run_dir / "drafter")
    proc = run_stage("train", *flags, "train.lr=5e-3", "train.epochs=6", "train.batch_size=2", check=False)
    line = one_line_error(proc, "train", "train.lr: 0.003 -> 0.005", "train.batch_size: 4 -> 2",
                          "train.epochs: 30 -> 6", "--fresh")
    assert "resumed from" not in proc.stderr, line
    assert files_of(run_dir / "drafter") == before
    manifest = json.loads((run_dir / "drafter" / "manifest.json").read_text())
    assert manifest["config"]["train"]["lr"] == 3e-3  # the manifest still tells what the drafter is


def test_grown_data_is_trained_anew_not_resumed(run):
    run_dir, flags = run
    run_stage("data_gen", *flags, "data_gen.num_samples=16")  # same settings, more conversations: extends
    run_stage("extract", *flags, "data_gen.num_samples=16")
    proc = run_stage("train", *flags, "data_gen.num_samples=16", check=False)
    one_line_error(proc, "train", "samples: 12 -> 16", "--fresh")
    run_stage("train", *flags, "data_gen.num_samples=16", "train.epochs=1", "--fresh")
    manifest = json.loads((run_dir / "drafter" / "manifest.json").read_text())
    assert manifest["settings"]["samples"] == 16 and manifest["counts"]["steps"] == 4  # 16 / batch 4, 1 epoch
    rows = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the old run's 90 rows are gone


def test_data_gen_refuses_another_targets_run_dir_and_changed_generation(run):
    run_dir, flags = run
    manifest = (run_dir / "conversations" / "manifest.json").read_bytes()
    proc = run_stage("data_gen", *flags, "target.model=smollm2-135m-instruct", check=False)
    one_line_error(proc, "data_gen", "target.model: 'tiny-random-llama' -> 'smollm2-135m-instruct'")
    proc = run_stage("data_gen", *flags, "data_gen.max_new_tokens=8", check=False)
    one_line_error(proc, "data_gen", "data_gen.max_new_tokens: 16 -> 8", "--fresh")
    assert (run_dir / "conversations" / "manifest.json").read_bytes() == manifest


def test_extract_refuses_conversations_regenerated_with_other_settings(run):
    run_dir, flags = run
    run_stage("data_gen", *flags, "data_gen.max_new_tokens=8", "--fresh")
    proc = run_stage("extract", *flags, check=False)
    one_line_error(proc, "extract", "conversations:", "--fresh")


# 4. one writer per stage dir ---------------------------------------------------------------------

def test_a_second_train_in_the_same_run_dir_fails_at_once_naming_the_first(run):
    """While a train runs: a second train fails naming the first; `extract --fresh` (and a plain extract) cannot
    delete or rewrite the shards it reads (issue 50, case 9), and the train goes on."""
    run_dir, flags = run
    hidden_before = files_of(run_dir / "hidden")
    first = subprocess.Popen([sys.executable, "-m", "train", *flags, "--fresh", "train.epochs=300"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = run_dir / "train" / LOCK_FILE
        wait_until(lambda: lock.is_file() and f"pid {first.pid}" in lock.read_text(), "the first train's lock",
                   timeout=120)
        one_line_error(run_stage("train", *flags, check=False), "train", f"pid {first.pid}", "one writer")
        for fresh in (["--fresh"], []):
            one_line_error(run_stage("extract", *flags, *fresh, check=False), "extract",
                           f"{run_dir / 'hidden'} is being read by a later stage", "wait for it to finish")
        assert files_of(run_dir / "hidden") == hidden_before
        assert first.poll() is None  # the first one goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_a_stage_does_not_read_what_its_upstream_is_still_writing(run):
    """A writer at work on conversations/ (its lock held, as data_gen holds it): extract and online train stop at
    once naming it, before reading a part."""
    from core.storage.stage_lock import stage_lock

    run_dir, flags = run
    with stage_lock(run_dir / "conversations", "data_gen"):
        for stage, extra in (("extract", []), ("train", ["train.source=online", "--fresh"])):
            one_line_error(run_stage(stage, *flags, *extra, check=False), stage,
                           f"{run_dir / 'conversations'} is being written (pid", "only once that stage has finished")


# 6. multi-process training on CPU (torchrun and accelerate launch --multi_gpu: tests/test_resume.py) -------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch path")
def test_accelerate_launch_that_would_run_one_process_is_refused(run):
    run_dir, flags = run
    accelerate = Path(sys.executable).with_name("accelerate")
    proc = subprocess.run([str(accelerate), "launch", "--num_processes", "2", "-m", "train", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "train: error: `accelerate launch --num_processes 2` started 1 process(es)" in proc.stderr


# 7, 8. one-line errors ---------------------------------------------------------------------------

def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  lr: [1e-4\n  epochs: 2\n")
    proc = run_stage("train", "--config", str(bad), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"train: error: {bad}:") and "YAML syntax" in proc.stderr


@pytest.mark.parametrize("mode", ["strict", "skip"])
def test_non_utf8_prompt_file_names_file_and_line(tmp_path, mode):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "hello there"}\n{"prompt": "caf\xe9"}\n{"prompt": "fine"}\n')
    from core.target.prompts import load_prompt_file

    if mode == "strict":
        with pytest.raises(UserError, match=rf"{prompts}:2: not UTF-8 text \(byte 0xe9\)"):
            load_prompt_file(prompts)
    else:
        from collections import Counter

        skipped = Counter()
        kept = load_prompt_file(prompts, strict=False, skipped=skipped)
        assert [p.id for p in kept] == ["1", "3"] and skipped == {"not_utf8": 1}


def test_data_gen_with_every_prompt_skipped_fails_and_keeps_the_data(run, tmp_path):
    run_dir, flags = run
    before = files_of(run_dir / "conversations")
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"tell me a long story number {i}"}) + "\n" for i in range(3)))
    proc = run_stage("data_gen", *flags, "--fresh", f"data_gen.prompts={prompts}", "data_gen.max_prompt_tokens=2",
                   check=False)
    one_line_error(proc, "data_gen", "no prompt is left", "prompt_too_long")
    assert files_of(run_dir / "conversations") == before  # --fresh empties the dir only for a run that can go on


def test_drafter_with_corrupt_config_or_of_another_target_is_one_line(overfit_tiny, run, tmp_path):
    cfg, run_dir = overfit_tiny[0], run[0]
    draft, mt = tmp_path / "drafter", str(ROOT / "tests/data/mt_bench_3.jsonl")
    shutil.copytree(run_dir / "drafter", draft)
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    one_line_error(run_stage("eval", *run[1], "--draft", str(draft), "--prompts", mt, check=False), "eval",
                   f"{draft}/config.json", "not valid JSON")

    from eval.run import main  # the other cases through main itself: the same checks, no CLI parsing

    shutil.copy(run_dir / "drafter" / "config.json", draft / "config.json")
    manifest = json.loads((draft / "manifest.json").read_text())
    manifest["compat"]["target"] = "smollm2-135m-instruct"
    (draft / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="target = 'smollm2-135m-instruct' but this run expects 'tiny-random-llama'"):
        main(cfg, prompts=mt, draft=str(draft), out=str(tmp_path / "eval"))

    (draft / "manifest.json").unlink()  # another trainer's drafter: only its config.json tells
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 151936}))
    with pytest.raises(UserError, match="drafter for a target of vocab 151936"):
        main(cfg, prompts=mt, draft=str(draft), out=str(tmp_path / "eval"))


def _in_tmpfs(script: str, size: str) -> subprocess.CompletedProcess:
    """Run a shell script with /mnt/run a fresh tmpfs of `size` (a private mount namespace: no root needed)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is needed to mount a private tmpfs")
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-ec",
                           f"mount -t tmpfs -o size={size} tmpfs /mnt && {script}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_full_disk_is_one_line_and_keeps_what_was_committed(tmp_path):
    py, out, log = sys.executable, tmp_path / "copy", tmp_path / "stderr"
    flags = "--config configs/tiny-random-llama.yaml --run-dir /mnt/run data_gen.num_samples=40"
    _in_tmpfs(f"{py} -m data_gen {flags} 2>{log} || echo rc=$? >>{log}; cp -r /mnt {out}", "32k")
    stderr = log.read_text()
    assert "rc=1" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "data_gen: error:" in stderr and "the disk is full" in stderr
    from core.storage.conversations import read_conversations

    conv = out / "run" / "conversations"
    parts = sorted(conv.glob("part-*.parquet"))
    kept = read_conversations(conv)["id"] if parts else []  # every committed part is whole and readable
    run_stage("data_gen", "--config", "configs/tiny-random-llama.yaml", "--run-dir", str(out / "run"),
            "data_gen.num_samples=40")
    ids = read_conversations(conv)["id"]
    assert len(ids) == 40 == len(set(ids)) and set(kept) <= set(ids)


def test_read_only_run_dir_is_one_line(run):
    run_dir, flags = run
    py = sys.executable
    args = " ".join(f"'{f}'" for f in flags).replace(str(run_dir), "/mnt/run")
    proc = _in_tmpfs(f"cp -r {run_dir} /mnt/run && rm -rf /mnt/run/hidden && mount -o remount,ro /mnt && "
                     f"{py} -m extract {args}", "64m")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "extract: error: /mnt/run/hidden" in proc.stderr and "read-only file system" in proc.stderr


@pytest.mark.parametrize("upstream, stage", [("hidden", "train"), ("conversations", "extract")])
def test_a_stage_refuses_an_upstream_that_has_not_finished(run, upstream, stage):
    """An upstream manifest that still says "in progress" (another process writing there, or one killed) is one
    line, before anything is read or written: train once trained on 22 of 400 samples that way with rc 0."""
    run_dir, flags = run
    manifest = run_dir / upstream / "manifest.json"
    record = json.loads(manifest.read_text())
    record["counts"] = {"status": "in progress"}
    manifest.write_text(json.dumps(record))
    before = files_of(run_dir / "drafter") if stage == "train" else files_of(run_dir / "hidden")
    one_line_error(run_stage(stage, *flags, check=False), stage, f"{run_dir / upstream}/manifest.json",
                   "has not finished", "in progress")
    assert (files_of(run_dir / "drafter") if stage == "train" else files_of(run_dir / "hidden")) == before


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_conversations_part_is_one_line_naming_it(run, damage):
    """One flipped bit inside a part's data (which parquet itself may not notice: extract and train once ran on
    changed token ids with rc 0) or a part cut short: extract stops naming the part, before writing anything."""
    run_dir, flags = run
    part = sorted((run_dir / "conversations").glob("part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x04
    else:
        data = data[: len(data) // 2]
    part.write_bytes(bytes(data))
    shutil.rmtree(run_dir / "hidden")
    line = one_line_error(run_stage("extract", *flags, check=False), "extract", str(part))
    assert ("bytes changed" in line) if damage == "flip" else ("bytes changed" in line or "not a readable" in line)
    assert not (run_dir / "hidden").exists() or not list((run_dir / "hidden").glob("shard-*"))


def test_a_part_removed_by_hand_is_regenerated_without_overwriting_another(tmp_path):
    """Deleting a damaged middle part (what its error says to do) and rerunning data_gen regenerates just its
    conversations into a new part; the parts after it are left as they were."""
    run_dir = tmp_path / "run"
    f = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(run_dir), "data_gen.num_samples=12"]
    run_stage("data_gen", *f)
    conv = run_dir / "conversations"
    parts = sorted(conv.glob("part-*.parquet"))
    assert len(parts) == 3
    last = parts[-1].read_bytes()
    parts[1].unlink()
    (conv / (parts[1].name + ".sha256")).unlink()
    run_stage("data_gen", *f)
    assert parts[-1].read_bytes() == last
    from core.storage.conversations import read_conversations
    ids = read_conversations(conv)["conversation_id"]
    assert len(ids) == 12 and len(set(ids)) == 12


def test_eval_on_training_prompts_says_so_first(run, overfit_tiny, tmp_path):
    """Eval pointed at prompts the drafter trained on (here all 12 of the tiny run's) measures a τ far above the
    held-out one: the report's first line says so and report.json names them; the same drafter on held-out prompts
    reports none (test_pipeline)."""
    run_dir, flags = run
    prompts = overfit_tiny[3]
    out = tmp_path / "eval"
    run_stage("eval", *flags, "--prompts", str(prompts), "--out", str(out), "--max-prompts", "4",
              "--max-new-tokens", "8")
    r = json.loads((out / "report.json").read_text())
    assert len(r["trained_on_prompts"]) == 4 == r["num_prompts"]
    assert (out / "report.md").read_text().startswith("> **Measured on training prompts: 4 of 4 eval prompts")
    held = tmp_path / "held"
    run_stage("eval", *flags, "--out", str(held), "--max-prompts", "2", "--max-new-tokens", "8")
    assert json.loads((held / "report.json").read_text())["trained_on_prompts"] == []


def test_a_speculative_output_that_differs_by_one_token_makes_the_report_say_no(run, monkeypatch, tmp_path):
    """The lossless check, tested by a planted mismatch: the speculative engine's answer to one prompt with one
    token changed must make report.json's outputs_match_baseline false, name that prompt, and the report say no."""
    from core.run.config import load_config
    from eval import run as eval_run

    run_dir, flags = run
    real = eval_run.speculative_generate
    calls = []

    def one_token_off(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the warm-up is call 1; the second prompt's answer gets one token changed
            out.tokens[1] = out.tokens[1] + 1
        return out

    monkeypatch.setattr(eval_run, "speculative_generate", one_token_off)
    cfg = load_config(ROOT / "configs/tiny-random-llama.yaml", [f"run_dir={run_dir}", *flags[4:]])
    r = eval_run.main(cfg, out=str(tmp_path / "eval"), max_prompts=3, max_new_tokens=8)
    assert r["outputs_match_baseline"] is False and len(r["mismatched_prompts"]) == 1
    assert "| outputs identical to the baseline | **no**: 2/3 prompts identical" in (tmp_path / "eval/report.md").read_text()


def test_every_optimizer_step_sees_gradients_clipped_to_grad_clip(run, monkeypatch):
    """train.grad_clip reaches the step: the gradients the optimizer steps on have a total norm of at most
    grad_clip (0.01 here, far under a fresh drafter's), and exactly that where the raw norm was above it."""
    from train import loop

    run_dir, flags = run
    norms = []
    make = loop.make_optimizer

    def recording(params, tc):
        opt = make(params, tc)
        opt.register_step_pre_hook(lambda o, args, kwargs: norms.append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for g in o.param_groups for p in g["params"]
                         if p.grad is not None])))))
        return opt

    monkeypatch.setattr(loop, "make_optimizer", recording)
    run_stage("train", *flags, "--fresh", "train.grad_clip=0.01", "train.epochs=1")
    assert len(norms) >= 3
    assert all(n <= 0.01 * (1 + 1e-4) for n in norms), norms
    assert max(norms) == pytest.approx(0.01, rel=1e-3), norms  # the raw norms were above it: clipped to it


def test_a_train_run_refused_for_a_bad_value_leaves_nothing_that_blocks_the_corrected_one(run):
    """A draft vocab larger than the target's, or kernels this device cannot run, are refused before any manifest
    is written, so the rerun with the value fixed needs no --fresh (it used to find the refused run's settings
    and ask for one)."""
    run_dir, flags = run
    shutil.rmtree(run_dir / "train")
    shutil.rmtree(run_dir / "drafter")
    one_line_error(run_stage("train", *flags, "train.draft_vocab_size=999999", check=False), "train",
                   "train.draft_vocab_size = 999999: must be in [1, 49152]")
    assert not (run_dir / "train/manifest.json").exists()
    if not torch.cuda.is_available():
        one_line_error(run_stage("train", *flags, "train.kernels.attention=flex", check=False), "train",
                       "train.kernels.attention = flex needs a CUDA device")
        assert not (run_dir / "train/manifest.json").exists()
    run_stage("train", *flags, "train.epochs=1")
    assert (run_dir / "drafter/model.safetensors").is_file()


def test_a_disk_that_fills_while_training_writes_is_one_line(run, tmp_path):
    """The disk fills when train writes its checkpoint (safetensors' and torch.save's own errors, not an OSError):
    one line naming the run dir and the bytes free, exit 1, and the shards it read are untouched."""
    run_dir, flags = run
    size = sum(f.stat().st_size for d in ("conversations", "hidden") for f in (run_dir / d).rglob("*") if f.is_file())
    py, log, out = sys.executable, tmp_path / "stderr", tmp_path / "copy"
    args = " ".join(f for f in flags[4:] if f.startswith("train.") is False)
    _in_tmpfs(f"cp -r {run_dir}/conversations {run_dir}/hidden /mnt/ && mkdir -p /mnt/run && mv /mnt/conversations "
              f"/mnt/hidden /mnt/run/ && {py} -m train --config configs/tiny-random-llama.yaml --run-dir /mnt/run "
              f"{args} train.epochs=1 2>{log} || echo rc=$? >>{log}; cp -r /mnt/run {out}",
              f"{size // 1024 + 400}k")
    stderr = log.read_text()
    assert "rc=1" in stderr and "Traceback" not in stderr, stderr[-3000:]
    line = next(x for x in reversed(stderr.splitlines()) if x.startswith("train: error:"))
    assert "/mnt/run: the disk is full" in line and "bytes free there" in line, line
    assert files_of(out / "hidden") == files_of(run_dir / "hidden")
