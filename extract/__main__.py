"""python -m extract --config configs/<name>.yaml [key=value ...]"""

import sys

from core.cli import parse_stage_args, run_main
from extract.run import main

if __name__ == "__main__":
    cfg, _ = parse_stage_args("extract", __doc__)
    sys.exit(run_main("extract", main, cfg))
