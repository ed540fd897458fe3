import dataclasses
import os
import re

import pytest

from core.run.config import TrainConfig, check_ranges, describe, load_config
from core.run.errors import UserError
from tests.conftest import ROOT, run_cli, run_stage


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", ["train.lr=3e-4", "extract.aux_layers=[1,2,3]"])
    assert cfg.train.lr == 3e-4 and cfg.extract.aux_layers == [1, 2, 3]
    assert cfg.run_path.as_posix() == "runs/smollm2-135m-instruct"


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", "unknown config key train.lrr \\(known"),
    ("train.attention=flex", "unknown config key train.attention; did you mean train.kernels.attention\\?"),
    ("nosuch.x=1", "unknown config key nosuch"),
    ("train.epochs=two", "train.epochs: expected an integer"),
    ("train.init_lm_head_from_target=3", "expected true/false"),
    ("train.lr", "expected key=value"),
])
def test_bad_config_is_a_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [override])


def test_unknown_key_in_yaml_names_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 1\n  ttt_stepz: 3\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown config key train.ttt_stepz"):
        load_config(bad)


def test_cli_rejects_bad_key_with_one_line_and_exit_2():
    proc = run_cli("extract", "train.bogus=1", check=False)
    assert proc.returncode == 2
    known = ", ".join(sorted(f.name for f in dataclasses.fields(TrainConfig)))
    assert proc.stderr.strip().splitlines()[-1] == (
        "extract: error: configs/smollm2-135m-instruct.yaml: unknown config key train.bogus "
        f"(known: {known})")  # from TrainConfig: a hand-kept list went stale twice


def test_help_lists_every_key():
    text = describe()
    for key in ("target.model", "data_gen.num_samples", "extract.aux_layers", "train.ttt_steps", "eval.draft_steps"):
        assert key in text


def test_stage_help_lists_its_own_keys_and_the_shared_ones():
    from core.run.cli import stage_parser

    text = stage_parser("train", "doc").format_help()
    assert all(k in text for k in ("  seed =", "target.model", "train.lr", "--fresh"))
    assert not re.search(r"^\s+(data_gen|extract|eval)\.\w+ =", text, re.M)  # other stages' keys (mentions are fine)
    assert re.search(r"^\s+train\.tau_every =", text, re.M)


def test_yaml_bare_no_and_yes_are_the_strings(tmp_path):
    """YAML 1.1 reads `compile: no` as false and `compile: yes` as true; the schema takes them as the strings
    they meant."""
    path = tmp_path / "c.yaml"
    path.write_text("data_gen:\n  compile: yes\ntrain:\n  kernels:\n    compile: no\n")
    cfg = load_config(path)
    assert cfg.data_gen.compile == "yes" and cfg.train.kernels.compile == "no"


def test_one_precision_vocabulary():
    """Weights, autocast and storage say fp32 / bf16 in the same words; torch's and Accelerate's names are refused
    with the choices."""
    cfg = load_config(overrides=["target.dtype=bf16", "extract.dtype=fp32", "train.mixed_precision=fp32"])
    assert (cfg.target.dtype, cfg.extract.dtype, cfg.train.mixed_precision) == ("bf16", "fp32", "fp32")
    for key, old in (("target.dtype", "bfloat16"), ("extract.dtype", "float32"), ("train.mixed_precision", "no")):
        with pytest.raises(UserError, match=re.escape(f"{key} = {old!r}: must be one of")):
            load_config(overrides=[f"{key}={old}"])


def test_check_compat_refuses_a_missing_or_different_key(tmp_path):
    from core.storage.manifest import check_compat

    manifest = {"compat": {"target": "tiny-random-llama"}}
    check_compat(manifest, {"target": "tiny-random-llama"}, tmp_path)
    with pytest.raises(ValueError, match="target = 'tiny-random-llama' but this run expects 'other'"):
        check_compat(manifest, {"target": "other"}, tmp_path)
    with pytest.raises(ValueError, match="no compat.aux_layers"):
        check_compat(manifest, {"aux_layers": [2, 15, 27]}, tmp_path)


@pytest.mark.parametrize("override, says", [
    ("eval.draft_steps=0", "eval.draft_steps = 0: must be >= 1"), ("eval.draft_steps=-2", "eval.draft_steps = -2"),
    ("train.epochs=-1", "train.epochs = -1: must be >= 1"), ("train.batch_size=0", "train.batch_size = 0"),
    ("train.lr=0", "train.lr = 0.0: must be > 0"), ("data_gen.heldout_percent=101", "must be >= 0 and <= 100"),
    ("data_gen.top_p=1.5", "data_gen.top_p = 1.5: must be > 0 and <= 1"), ("eval.concurrency=[1,0]", "eval.concurrency"),
    ("extract.aux_layers=[2,-1,5]", "extract.aux_layers = [2, -1, 5]: must be >= 0"),
    ("eval.max_prompts=0", "eval.max_prompts = 0"), ("eval.max_new_tokens=0", "eval.max_new_tokens = 0"),
    ("train.kernels.pack_length=127", "train.kernels.pack_length = 127: must be 0 (off) or >= train.max_len (128)"),
    ("eval.target_outtype=q3", "eval.target_outtype = 'q3': must be one of '' | 'f32'"),
    ("eval.gguf_outtype=fp16", "eval.gguf_outtype = 'fp16': must be one of 'f32' | 'f16'"),
    ("eval.draft_p_min=-0.5", "eval.draft_p_min = -0.5: must be >= 0"),
])
def test_values_out_of_range_name_the_key_at_load(override, says):
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        load_config(ROOT / "configs/tiny-random-llama.yaml", [override])
    assert str(e.value).startswith(str(ROOT / "configs/tiny-random-llama.yaml"))


@pytest.mark.parametrize("mode", ["eval.temperature=0.7", "eval.draft_tree=[3,2,6]", "eval.engine=server"])
def test_p_min_is_refused_where_no_greedy_chain_of_ours_or_llamacpps_runs(mode):
    with pytest.raises(ValueError, match=re.escape("eval.draft_p_min = 0.5: it stops a greedy chain")):
        load_config(ROOT / "configs/tiny-random-llama.yaml", ["eval.draft_p_min=0.5", mode])


def test_every_shipped_config_is_in_range():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        check_ranges(load_config(path))


def test_threads_come_from_the_key_then_omp_num_threads_then_the_idle_cores(monkeypatch):
    import subprocess
    import sys

    import torch

    from core.run.cli import idle_cores, set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_threads(3) == 3 == torch.get_num_threads()
        assert set_threads(0) == 1 == torch.get_num_threads()
        monkeypatch.delenv("OMP_NUM_THREADS")
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            assert idle_cores(0.5) < os.cpu_count()  # a core held by another process is not counted
            assert 1 <= set_threads(0) <= max(1, os.cpu_count() - 1)
        finally:
            busy.kill()
            busy.wait()
    finally:
        torch.set_num_threads(before)


def enum_keys(cfg=None, prefix: str = "") -> list[tuple[str, tuple]]:
    """Every config key declared with choices, sections within sections too, as (dotted key, choices)."""
    from core.run.config import RunConfig

    cfg, out = cfg if cfg is not None else RunConfig(), []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += enum_keys(value, f"{prefix}{f.name}.")
        elif f.metadata.get("choices"):
            out.append((f"{prefix}{f.name}", f.metadata["choices"]))
    return out


def test_every_enum_of_the_config_is_declared():
    keys = enum_keys()
    assert len(keys) == 24 and ("train.kernels.attention", ("auto", "dense", "flex", "cudnn")) in keys
    assert ("train.draft_attention", ("gqa", "mla")) in keys and ("train.loss", ("kl", "lk_alpha", "lk_lambda")) in keys


@pytest.mark.parametrize("key, choices", enum_keys(), ids=[k for k, _ in enum_keys()])
def test_a_bad_enum_value_is_refused_by_dry_run_naming_the_key_and_its_choices(key, choices):
    stage = key.split(".")[0] if key.split(".")[0] in ("data_gen", "extract", "train", "eval") else "train"
    proc = run_stage(stage, "--config", "configs/tiny-random-llama.yaml", "--dry-run", f"{key}=flsh", check=False)
    assert proc.returncode == 2, proc.stderr[-500:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"{key} = 'flsh': must be one of " + " | ".join(map(repr, choices)) in line
