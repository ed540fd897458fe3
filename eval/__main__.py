"""python -m eval --config configs/<name>.yaml [--engine hf|llamacpp|server] [--prompts FILE] [--draft DIR]
[--out DIR] [key=value ...]
python -m eval compare DIR DIR [...] [--out DIR]   drafters side by side (reports of --engine llamacpp runs)"""

import argparse
import sys

from core.run.cli import parse_stage_args, run_main
from core.run.config import RunConfig
from eval.run import add_eval_args, cli_overrides, main

if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"]:
        from eval.compare import main as compare

        p = argparse.ArgumentParser(prog="eval compare", description=__doc__)
        p.add_argument("reports", nargs="+", help="eval report dirs (each with report.json)")
        p.add_argument("--out", default=None, help="where compare.md goes (default: the first report dir)")
        args = p.parse_args(sys.argv[2:])
        sys.exit(run_main("eval compare", lambda _cfg: sys.stdout.write(f"{compare(args.reports, args.out)}\n"), RunConfig()))
    cfg, args = parse_stage_args("eval", __doc__, extend=add_eval_args)
    sys.exit(run_main("eval", main, cfg, prompts=args.prompts, draft=args.draft, out=args.out, **cli_overrides(args)))
