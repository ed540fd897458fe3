"""DeepSpeed ZeRO-2 and ZeRO-3 for real, on CPU: DeepSpeed's CPU accelerator over gloo, launched by `accelerate
launch --config_file` with the shipped scripts/accelerate/deepspeed_zero{2,3}.yaml and their JSON (only the
process count, use_cpu and the JSON's path rewritten), on the tiny random target's shards.

- one process, fp32: ZeRO-3 trains to the plain run's weights at a low train.grad_clip (the same step math:
  DeepSpeed clips at the run's clip and steps the same AdamW);
- two processes: a ZeRO-2 run stopped at a checkpoint (train.stop_after) and rerun ends at the weights of the
  uninterrupted run, and a ZeRO-3 run killed (-9) after a checkpoint then rerun does too (its export gathers the
  full weights); one process can't take over its shards;
- ZeRO-3 with the compiled K-step unroll (captured, aot_eager) and with the target online, in one launch;
- a DeepSpeed JSON whose value conflicts with the run config's is one error naming both (configure_deepspeed).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from core.run.config import TrainConfig
from core.run.errors import UserError
from core.storage.stage_lock import LOCK_FILE
from tests.conftest import ROOT, run_stage
from train.checkpoint import read_latest
from train.deepspeed_config import configure_deepspeed, precision_keys

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch path (GPU: docs/PERFORMANCE.md)")
TRAIN = ["train.mixed_precision=fp32", "train.wandb_mode=disabled", "threads=1"]


@pytest.fixture
def new_run(overfit_tiny, tmp_path):
    """-> new_run(name): a run dir holding a copy of the tiny run's conversations and hidden shards."""
    import shutil

    def make(name: str) -> Path:
        for stage_dir in ("conversations", "hidden"):
            shutil.copytree(overfit_tiny[1] / stage_dir, tmp_path / name / stage_dir,
                            ignore=shutil.ignore_patterns(LOCK_FILE))
        return tmp_path / name
    return make


def launch_config(tmp_path: Path, stage: int, processes: int) -> Path:
    """The shipped accelerate config of ZeRO `stage` for this machine: `processes` CPU processes."""
    shipped = yaml.safe_load((ROOT / f"scripts/accelerate/deepspeed_zero{stage}.yaml").read_text())
    ds_json = json.loads((ROOT / shipped["deepspeed_config"]["deepspeed_config_file"]).read_text())
    path = tmp_path / f"zero{stage}-{processes}.json"
    if stage == 3:  # partition every weight: by default ZeRO-3 keeps weights under 1e5 values (all of the tiny
        ds_json["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # drafter's) whole on each rank
    path.write_text(json.dumps(ds_json))
    shipped.update(num_processes=processes, use_cpu=True, main_process_port=free_port())
    shipped["deepspeed_config"]["deepspeed_config_file"] = str(path)
    out = tmp_path / f"zero{stage}-{processes}.yaml"
    out.write_text(yaml.safe_dump(shipped))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: Path, run_dir: Path, *extra: str, check: bool = True, background: bool = False):
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config), "-m", "train",
           "--config", "configs/tiny-random-llama.yaml", "--run-dir", str(run_dir), *TRAIN, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "drafter/model.safetensors"))


def assert_same_weights(got: dict, want: dict, atol: float) -> None:
    """Equal within atol, except where fp32 masters that agree to their last bits round to neighbouring bf16 values
    in the export: at most one bf16 step apart, in at most 0.1% of a tensor's elements (ZeRO-3's partitioned
    reductions on an AVX2 CPU: 1 element of 8,192). An empty partition, a missed clip or step moves far more."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert tensor.numel() and got[name].shape == tensor.shape, name  # a ZeRO-3 partition would be empty
        a, b = got[name].float(), tensor.float()
        off = (a - b).abs() > atol
        if tensor.dtype == torch.bfloat16 and off.any():
            step = torch.ldexp(torch.ones_like(b), torch.frexp(b)[1] - 8)  # one bf16 step at each value
            assert ((a - b).abs() <= step)[off].all() and off.float().mean() <= 1e-3, (name, int(off.sum()))
        else:
            assert not off.any(), name


def test_zero3_takes_the_plain_step_at_the_runs_clip(new_run, tmp_path, two_process_weights):
    """One process in fp32 at a clip far lower than the default: DeepSpeed's step is the plain step (clip at
    train.grad_clip, AdamW, the lr schedule), so ZeRO-3 exports the plain run's drafter at that clip, which parts
    from the default clip's: the launch trains under DeepSpeed and the clip reaches it."""
    plain = new_run("plain")
    run_stage("train", "--config", "configs/tiny-random-llama.yaml", "--run-dir", str(plain), *TRAIN,
              "train.grad_clip=0.01")
    run = new_run("zero3")
    proc = launch(launch_config(tmp_path, 3, 1), run, "train.grad_clip=0.01")
    assert "(DistributedType.DEEPSPEED)" in proc.stderr
    assert "shm_comm" not in proc.stdout + proc.stderr  # its C++ op is neither built nor loaded (skip_shm_comm_build)
    assert json.loads((run / "train/manifest.json").read_text())["runtime"]["distributed"].endswith("DEEPSPEED")
    low, default = weights(plain), two_process_weights  # the default clip's: far more than a bf16 step away
    assert_same_weights(weights(run), low, atol=1e-6)
    assert max((low[k].float() - default[k].float()).abs().max() for k in default) > 1e-3


@pytest.fixture(scope="module")
def two_process_weights(overfit_tiny, tmp_path_factory):
    """The drafter of an uninterrupted two-process ZeRO-2 run: where a stopped-and-rerun run of either stage must
    end (ZeRO-3 takes the plain step: test above). Not the one-process plain run: two processes reduce the same
    gradients in another order, and the bf16 export of fp32 masters 1e-7 apart differs by one step in ~10% of
    the elements."""
    import shutil

    tmp = tmp_path_factory.mktemp("ds-ref")
    for stage_dir in ("conversations", "hidden"):
        shutil.copytree(overfit_tiny[1] / stage_dir, tmp / "ref" / stage_dir, ignore=shutil.ignore_patterns(LOCK_FILE))
    log = launch(launch_config(tmp, 2, 2), tmp / "ref").stderr
    assert "world size 2 (DistributedType.DEEPSPEED)" in log
    return weights(tmp / "ref")


def test_two_processes_stopped_at_a_checkpoint_and_rerun_end_where_the_uninterrupted_run_ends(
        new_run, tmp_path, two_process_weights):
    """ZeRO-2 shards the optimizer state over the two ranks: a checkpoint holds each rank's shard in DeepSpeed's
    layout, and the rerun on two processes continues to the same weights."""
    config, run = launch_config(tmp_path, 2, 2), new_run("run")
    launch(config, run, "train.stop_after=2")
    assert not (run / "drafter").exists()
    latest = json.loads((run / "train/checkpoints/latest.json").read_text())
    assert (latest["step"], latest["world_size"]) == (2, 2)
    assert "resumed from step-0000002" in launch(config, run).stderr
    assert_same_weights(weights(run), two_process_weights, atol=1e-6)


def test_kill_9_under_zero3_then_rerun_ends_at_the_uninterrupted_weights(new_run, tmp_path, two_process_weights):
    """ZeRO-3 partitions the weights too: the step gathers the weights it reads outside their modules, a checkpoint
    holds each rank's partitions, and the export the full weights (a rank's partition would be empty). kill -9
    of the launcher and both ranks after a checkpoint; one process can't read the two ranks' shards (read_latest
    on that checkpoint, as a one-process DeepSpeed launch calls it: a launch's one-line errors are
    tests/test_run_integrity.py's); two continue to the uninterrupted run's weights."""
    config, run = launch_config(tmp_path, 3, 2), new_run("run")
    proc = launch(config, run, "train.save_every=1", background=True)
    latest, deadline = run / "train/checkpoints/latest.json", time.time() + 300
    while not (latest.exists() and json.loads(latest.read_text())["step"] >= 2):
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks
    proc.wait()
    assert not (run / "drafter").exists()
    with pytest.raises(UserError, match="written by 2 processes under DeepSpeed, whose ZeRO optimizer state is sharded"):
        read_latest(stand_in({}, stage=3, processes=1), run / "train/checkpoints")
    assert "resumed from step-" in launch(config, run, "train.save_every=1").stderr
    assert_same_weights(weights(run), two_process_weights, atol=1e-6)


def test_zero3_gathers_what_a_compiled_step_reads_and_keeps_the_online_target_whole(overfit_tiny, tmp_path):
    """Two ZeRO-3 hazards, one launch. The K-step unroll as one torch.compile graph (auto on CUDA for wide
    drafters) reads the projections' weights directly, where DeepSpeed gathers nothing on its own (it does in
    eager steps): registered on the objective they are gathered for its whole forward; without that the first
    step indexes a 1-D partition. train.source=online runs the target in the training process, outside
    DeepSpeed's engine: transformers must not build it split over the ranks (ZeRO-3's zero.Init), or its first
    forward fails. The graph through aot_eager: dynamo captures what inductor would be handed (the partition is
    read while tracing), without inductor's C++ build of its kernels (this launch: 22 s against 68 s on an empty
    inductor cache)."""
    import shutil

    run = tmp_path / "online"
    shutil.copytree(overfit_tiny[1] / "conversations", run / "conversations", ignore=shutil.ignore_patterns(LOCK_FILE))
    launch(launch_config(tmp_path, 3, 1), run, "train.source=online", "train.kernels.compile=unroll",
           "train.kernels.compile_backend=aot_eager", "train.stop_after=1")
    assert json.loads((run / "train/checkpoints/latest.json").read_text())["step"] == 1


def stand_in(ds_config: dict, stage: int = 2, processes: int = 2):
    plugin = types.SimpleNamespace(deepspeed_config=ds_config, zero_stage=stage)
    return types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin), num_processes=processes)


def test_the_run_config_fills_deepspeeds_auto_values():
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto", "bf16": {"enabled": True}}  # Accelerate's
    configure_deepspeed(stand_in(ds, stage=3), TrainConfig(grad_clip=0.7, batch_size=3), accum=2, precision="bf16")
    assert (ds["gradient_clipping"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"],
            ds["train_batch_size"]) == (0.7, 2, 3, 12)
    # bf16 as in a plain run: fp32 weights under autocast, not DeepSpeed's bf16 weights
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    fp32 = {}
    configure_deepspeed(stand_in(fp32), TrainConfig(), accum=1, precision="fp32")
    assert fp32["torch_autocast"]["enabled"] is False


@pytest.mark.parametrize("key, value, error", [
    ("gradient_clipping", 1.0, "gradient_clipping = 1.0, but the run's train.grad_clip = 0.5"),
    ("train_micro_batch_size_per_gpu", 8, "train_micro_batch_size_per_gpu = 8, but the run's train.batch_size = 4"),
])
def test_a_deepspeed_value_that_conflicts_with_the_run_config_is_refused(key, value, error):
    with pytest.raises(UserError, match=error):
        configure_deepspeed(stand_in({key: value}), TrainConfig(batch_size=4), accum=1, precision="fp32")


@pytest.mark.parametrize("written, error", [
    ({"bf16": {"enabled": True}}, "bf16.enabled = true: DeepSpeed's bf16 mode trains bf16 weights"),
    ({"fp16": {"enabled": True}}, "fp16.enabled = true: DeepSpeed's fp16 mode trains fp16 weights"),
    ({"torch_autocast": {"enabled": False}}, "torch_autocast.enabled = False, but the run trains in bf16"),
])
def test_a_half_precision_mode_the_run_does_not_train_in_is_refused(written, error):
    """What the user's JSON says, before Accelerate filled its "auto" values (bf16.enabled from the launch)."""
    with pytest.raises(UserError, match=error):
        precision_keys({}, written, "zero.json", TrainConfig(mixed_precision="bf16"), "bf16")
    precision_keys(ds := {}, {"bf16": {"enabled": "auto"}}, "zero.json", TrainConfig(), "bf16")
    assert ds["bf16"]["enabled"] is False and ds["torch_autocast"]["enabled"] is True
