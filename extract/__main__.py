"""python -m extract --config configs/<name>.yaml [key=value ...]
python -m extract --engine sglang|vllm --server http://127.0.0.1:30000 [--config ...]   (= extract.engine / server_url)
python -m extract stats [--config ... | --hidden DIR]   bytes/token of the shards, beside the alternatives"""

import sys
from pathlib import Path

from core.run.cli import parse_stage_args, run_main


def stats(cfg, hidden: str | None) -> None:
    from extract.shard_stats import format_stats, storage_stats

    sys.stdout.write(format_stats(storage_stats(Path(hidden) if hidden else cfg.run_path / "hidden")) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["stats"]:
        cfg, args = parse_stage_args("extract stats", __doc__, argv=sys.argv[2:], extend=lambda p: p.add_argument(
            "--hidden", default=None, help="hidden shard dir (default <run>/hidden)"))
        sys.exit(run_main("extract stats", stats, cfg, args.hidden))
    from extract.run import main

    def engine_flags(p):
        p.add_argument("--engine", default=None, help="hf | sglang | vllm (overrides extract.engine)")
        p.add_argument("--server", default=None, help="the server's root URL (overrides extract.server_url)")

    def apply_engine_flags(cfg, args):
        cfg.extract.engine = args.engine or cfg.extract.engine
        cfg.extract.server_url = args.server or cfg.extract.server_url

    cfg, args = parse_stage_args("extract", __doc__, extend=engine_flags, apply=apply_engine_flags)
    sys.exit(run_main("extract", main, cfg, fresh=args.fresh))
