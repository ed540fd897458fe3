"""python -m eval --config configs/<name>.yaml [--engine hf|llamacpp|server] [--prompts FILE] [--draft DIR]
[--out DIR] [key=value ...]"""

import sys

from core.cli import parse_stage_args, run_main
from eval.run import add_eval_args, cli_overrides, main

if __name__ == "__main__":
    cfg, args = parse_stage_args("eval", __doc__, extend=add_eval_args)
    sys.exit(run_main("eval", main, cfg, prompts=args.prompts, draft=args.draft, out=args.out, **cli_overrides(args)))
