"""python -m data_gen --config configs/<name>.yaml [key=value ...]"""

import sys

from core.run.cli import parse_stage_args, run_main
from data_gen.generate import main

if __name__ == "__main__":
    cfg, args = parse_stage_args("data_gen", __doc__)
    sys.exit(run_main("data_gen", main, cfg, fresh=args.fresh))
