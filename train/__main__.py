"""python -m train --config configs/<name>.yaml [key=value ...]   (or: accelerate launch -m train ...)"""

import sys

from core.run.cli import parse_stage_args, run_main
from train.loop import main

if __name__ == "__main__":
    cfg, args = parse_stage_args("train", __doc__)
    sys.exit(run_main("train", main, cfg, fresh=args.fresh))
