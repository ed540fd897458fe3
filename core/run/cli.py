"""The command line every stage shares: --config, --run-dir, --fresh and `key=value` overrides.

User errors (core.run.errors.UserError, and the OS refusing a write: disk full, read-only dir, no
permission, no such file) print one line and exit non-zero; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from core.run.config import RunConfig, check_ranges, describe, load_config
from core.run.errors import UserError

STAGES = ("data_gen", "extract", "train", "eval")
RESUMABLE = ("data_gen", "extract", "train")
DEFAULT_CONFIG = "configs/smollm2-135m-instruct.yaml"
_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space or pass a --run-dir on a larger disk, then rerun (it resumes)",
    errno.EDQUOT: "disk quota exceeded: free space or pass a --run-dir elsewhere, then rerun (it resumes)",
    errno.EROFS: "read-only file system: pass a writable --run-dir",
    errno.EACCES: "permission denied: pass a --run-dir you can write, or fix its permissions",
    errno.EPERM: "operation not permitted: pass a --run-dir you own",
    errno.ENOENT: "no such file or directory",
}


def stage_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    section = prog.split()[0] if prog.split()[0] in STAGES else None  # the demo runs them all
    p = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"config keys of {section or 'every stage'} and the shared ones (override as key=value):\n"
               + describe(section),
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--run-dir", default=None, help="output root (default runs/<name>)")
    if prog in RESUMABLE or section is None:
        p.add_argument("--fresh", action="store_true",
                       help="start over in place: empty the stage's output dir first (other stages' output is kept)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what the stage would do (tokens, bytes, memory, steps, hours) and exit; loads no weights")
    p.add_argument("--world-size", type=int, default=1, help="with --dry-run: training processes (GPUs) to plan for")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    return p


def parse_stage_args(prog: str, doc: str, extend=None, argv=None, apply=None) -> tuple[RunConfig, argparse.Namespace]:
    """Parse a stage's CLI into a validated config; bad input exits 2 with a one-line message. `extend` adds a
    stage's own flags to the parser, `apply(cfg, args)` sets them on the config (before --dry-run plans it)."""
    parser = stage_parser(prog, doc)
    if extend is not None:
        extend(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may sit between flags
    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    if args.run_dir:
        cfg.run_dir = args.run_dir
    if apply is not None:
        apply(cfg, args)
        try:
            check_ranges(cfg)
        except UserError as e:
            parser.exit(2, f"{prog}: error: {e}\n")
    if args.dry_run:
        dry_run(parser, prog, cfg, args)
    setup_logging()
    set_threads(cfg.threads)
    keep_freed_memory()
    return cfg, args


def dry_run(parser: argparse.ArgumentParser, prog: str, cfg: RunConfig, args: argparse.Namespace) -> None:
    """Print the stage's plan (core/run/plan.py; every stage for the demo runner) and exit 0."""
    from core.run.plan import format_plan

    section = prog.split()[0] if prog.split()[0] in STAGES else None
    try:
        text = format_plan(cfg, [section] if section else None, args.world_size, args.config)
    except UserError as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    sys.stdout.write(text + "\n")
    parser.exit(0)


def env_threads() -> int | None:
    """$OMP_NUM_THREADS when it is a positive integer (launchers and `make test` set it per process), else None."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def set_threads(threads: int) -> int:
    """torch's intra-op threads: `threads`, else $OMP_NUM_THREADS (launchers set it per process), else
    the cores idle right now (at most torch's default): spinning threads on a core that another
    process holds lose whole time slices, while on an idle machine every core pays (docs/PERFORMANCE.md)."""
    import torch

    env = env_threads()
    if threads:
        n, why = threads, "threads"
    elif env:
        n, why = env, "$OMP_NUM_THREADS"
    else:
        idle = idle_cores()
        n = max(1, min(torch.get_num_threads(), idle if idle is not None else torch.get_num_threads()))
        why = f"{idle} of {os.cpu_count()} cores idle" if idle is not None else "torch's default"
    torch.set_num_threads(n)
    logging.getLogger("eagle3").info("torch threads: %d (from %s)", n, why)
    return n


def keep_freed_memory() -> bool:
    """On a machine without CUDA, have glibc's malloc keep freed memory for reuse instead of handing it back: it
    maps every block over 32 MB afresh (a draft-vocab logits chunk, DFlash's full-vocab teacher rows) and the
    kernel zeroes each new page, which cost a CPU training step more system time than its matmuls' user time
    (tests/test_llamacpp_serving.py's DFlash run: 11.0 s of system time in 24 steps, 1.5 s so; peak memory +9%).
    -> whether it applied (glibc only; GPU machines keep the defaults: their hosts load hundreds of GB)."""
    import ctypes
    import ctypes.util

    import torch

    if torch.cuda.is_available() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # another C library
        return False


def idle_cores(window_s: float = 0.3) -> int | None:
    """Cores no process used over a short window (Linux /proc/stat), rounded; None where unreadable."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    try:
        idle0, total0 = sample()
        time.sleep(window_s)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    share = (idle1 - idle0) / max(1, total1 - total0)
    return int(share * (os.cpu_count() or 1) + 0.25)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    for noisy in ("httpx", "accelerate", "datasets"):  # per-request / per-checkpoint INFO lines drown the progress
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_main(prog: str, main, cfg, *a, **kw) -> int:
    """Call a stage's main; user errors print one line and exit 1."""
    try:
        main(cfg, *a, **kw)
    except UserError as e:
        _error_line(f"{prog}: error: {e}")
        return 1
    except OSError as e:
        if e.errno not in _OS_HINTS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        _error_line(f"{prog}: error: {where}{_OS_HINTS[e.errno]} ({e.strerror})")
        return 1
    except Exception as e:  # a full disk in a writer's own words (safetensors' Rust, torch.save): told by the disk
        free = _free_bytes(cfg.run_path)
        if free is None or free > FULL_DISK_BYTES:
            raise
        _error_line(f"{prog}: error: {cfg.run_path}: {_OS_HINTS[errno.ENOSPC]} ({free:,} bytes free there when "
                    f"{type(e).__name__}: {str(e)[:160]})")
        return 1
    return 0


FULL_DISK_BYTES = 1 << 20  # an error while this little is free on the run dir's disk is that disk being full


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent); None if unreadable."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _error_line(text: str) -> None:
    """The error on a line of its own: progress bars the error interrupted are closed first."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):
        bar.close()
    sys.stderr.write(text + "\n")
