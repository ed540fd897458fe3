"""The command line every stage shares: --config, --run-dir, and `key=value` overrides."""

from __future__ import annotations

import argparse
import logging
import sys

from core.config import RunConfig, describe, load_config

DEFAULT_CONFIG = "configs/smollm2-135m-instruct.yaml"


def stage_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override as key=value):\n" + describe(),
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--run-dir", default=None, help="output root (default runs/<name>)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    return p


def parse_stage_args(prog: str, doc: str, extend=None, argv=None) -> tuple[RunConfig, argparse.Namespace]:
    """Parse a stage's CLI into a validated config; bad input exits 2 with a one-line message."""
    parser = stage_parser(prog, doc)
    if extend is not None:
        extend(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may sit between flags
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    if args.run_dir:
        cfg.run_dir = args.run_dir
    setup_logging()
    return cfg, args


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per HTTP request drowns the progress


def run_main(prog: str, main, cfg, *a, **kw) -> int:
    """Call a stage's main; user errors (bad files/fields) print one line and exit 1."""
    try:
        main(cfg, *a, **kw)
    except (ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 1
    return 0
