"""Shared fixtures: real configs pointed at tmp run dirs; targets come from the embedded packages."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from core.run.config import load_config

ROOT = Path(__file__).resolve().parents[1]

# The slowest files (worker-seconds on 2 cores, most first): `make test` hands whole files to its two workers in
# collection order (--dist loadfile --no-loadscope-reorder), so the files that start last are short ones and the
# workers finish together. The first two do not wait on each other: only the second builds overfit_tiny.
SLOW_FIRST = ("test_llamacpp_export.py", "test_llamacpp_serving.py", "test_deepspeed.py", "test_resume.py", "test_data_gen_openai.py",
              "test_run_integrity.py", "test_speculative_modes.py", "test_draft_alignment.py", "test_pipeline.py",
              "test_decode.py", "test_extract_sglang.py", "test_data_gen_llamacpp.py", "test_tokenizer_parity.py",
              "test_gguf_checkpoint.py")


# The files whose tests start llama-server. Where it is not built yet, `make test` builds it in the background
# (eval/llamacpp_build.py) and these start after the other slow files, in their SLOW_FIRST order, their first
# call waiting on the build; the short files come last and fill both workers' ends (the serving file alone is
# ~110 s: run last, one worker idled that long). On a fresh 2-core AVX2 EPYC the build was done at 6:09 and
# the workers reached this group at ~7:40.
SERVE_LLAMACPP = ("test_llamacpp_serving.py", "test_tokenizer_parity.py", "test_data_gen_llamacpp.py")


def pytest_collection_modifyitems(items):
    from eval.llamacpp_build import cached_server_binary, default_cache

    serve_later = cached_server_binary(default_cache()) is None

    def group(item) -> tuple[int, int]:  # (slow, then serving while it builds, then the rest; place in SLOW_FIRST)
        name = item.path.name
        if name not in SLOW_FIRST:
            return 2, 0
        return int(serve_later and name in SERVE_LLAMACPP), SLOW_FIRST.index(name)

    items.sort(key=group)  # stable: file order kept within


@pytest.fixture(autouse=True, scope="module")
def fresh_accelerate_state():
    """Accelerate fixes the mixed precision once per process. On a CPU with native bf16, train.mixed_precision=auto
    trains in bf16, so a file that trains in fp32 (tests/test_train_online.py) after one that trained in bf16 in
    the same test worker was refused at its first Accelerator: each file starts from a cleared state (autouse
    module fixtures run before the file's own module fixtures)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield


@pytest.fixture
def tiny_cfg(tmp_path):
    """The debug config (4-layer random Llama, SmolLM2 tokenizer) writing under tmp_path."""
    return load_config(ROOT / "configs/tiny-random-llama.yaml", [f"run_dir={tmp_path / 'run'}"])


@pytest.fixture
def smol_cfg(tmp_path):
    return load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [f"run_dir={tmp_path / 'run'}"])


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m <stage> ...` from the repo root, as a user would."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def run_stage(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m <stage> ...` in this process: the stage's own `__main__` (argument parsing, run_main's
    one-line errors, its exit code) run by runpy, without a new interpreter's 5-6 s of imports. For
    tests about a stage's behaviour; those about processes (kill -9, launchers, locks held by another
    process, a private mount namespace) start real ones with run_cli / Popen. -> returncode, stdout,
    stderr as a subprocess would give them: the stage's log lines (INFO and up) and progress bars, its
    error line, or the traceback of an exception it let through (exit 1, as the interpreter would)."""
    import io
    import logging
    import runpy
    import traceback
    from contextlib import redirect_stderr, redirect_stdout

    import torch

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = sys.argv, root.level, list(root.handlers), os.getcwd(), torch.get_num_threads()
    sys.argv = [f"{args[0]}/__main__.py", *args[1:]]
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    os.chdir(ROOT)
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            runpy.run_module(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            err.write(f"{e.code}\n")
    except Exception:  # noqa: BLE001 - what the interpreter would print: a traceback, exit 1
        err.write(traceback.format_exc())
        code = 1
    finally:
        sys.argv, level, handlers, cwd, threads = saved
        root.handlers[:] = handlers  # also drops any a basicConfig added
        root.setLevel(level)
        os.chdir(cwd)
        torch.set_num_threads(threads)
    proc = subprocess.CompletedProcess(["python", "-m", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{args[0]} exited {code}:\n{proc.stderr[-3000:]}")
    return proc


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    """Poll `cond` instead of sleeping a guessed time: done as soon as it holds, a clear failure
    naming `what` if it does not within `timeout` seconds (a slow CI box only makes it wait longer)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


def kill9_after_rows(args: list[str], index: Path, rows: int, timeout: float = 120.0) -> None:
    """Start `python args...` in the repo, SIGKILL it once `index` (a stage's append-only index) holds `rows`
    lines: a crash at a moment the stage did not choose."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not (index.exists() and len(index.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def holds_for(cond, what: str, seconds: float) -> None:
    """Show that something does NOT happen: `cond` must hold at every poll for `seconds`. Pair it with
    a positive check afterwards, so a test that never got going cannot pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not cond():
            pytest.fail(f"stopped holding: {what}")
        time.sleep(0.01)


def masked_spans(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded runs of consecutive loss-mask-1 tokens: what a sample trains on, turn by turn."""
    spans, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans + ([tok.decode(cur)] if cur else [])


def trained_next(loss_mask) -> list[bool]:
    """The teacher-position rule, restated independently of core.storage.hidden_shards.teacher_positions so
    that tests check it: position j is a teacher target iff token j+1 is trained on."""
    m = [bool(x) for x in loss_mask]
    return m[1:] + [False]


OVERFIT = ["train.epochs=30", "train.lr=3e-3", "train.wandb_mode=offline", "eval.draft_steps=3", "eval.max_new_tokens=16", "eval.max_prompts=12",
           "train.tau_every=45", "train.tau_prompts=2", "train.tau_new_tokens=12"]


@pytest.fixture(scope="session")
def overfit_tiny(tmp_path_factory):
    """A drafter from the real pipeline (CLI stages) on the tiny target, trained until it memorises the
    target's 12 greedy answers -> (cfg, run_dir, CLI flags, a prompt file of those 12 prompts). On its
    own prompts τ is far above 1, so engine disagreements and decode bugs show."""
    import json

    from core.storage.conversations import read_conversations

    with built_once(tmp_path_factory, "overfit") as (root, built):
        run_dir = root / "run"
        cfg = load_config(ROOT / "configs/tiny-random-llama.yaml", [f"run_dir={run_dir}", *OVERFIT])
        flags = ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(run_dir), *OVERFIT]
        prompts = run_dir / "train_prompts.jsonl"
        if not built:
            for stage in ("data_gen", "extract", "train"):
                run_stage(stage, *flags)
            prompts.write_text("".join(json.dumps({"id": r["conversation_id"], "prompt": r["messages"][0]["content"]})
                                       + "\n" for r in read_conversations(run_dir / "conversations")))
    return cfg, run_dir, flags, prompts


@contextmanager
def built_once(tmp_path_factory, name: str):
    """-> (dir, already built?): under `make test`'s xdist workers, one dir for the whole test run,
    built by the first worker that asks while the others wait on a lock; without xdist a private one."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        yield tmp_path_factory.mktemp(name), False
        return
    root = tmp_path_factory.getbasetemp().parent / f"{name}-{uid}"
    root.mkdir(exist_ok=True)
    with open(root.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / ".built"
        built = done.exists()
        yield root, built
        done.touch()
