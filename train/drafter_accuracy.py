"""Teacher-forced accuracy of an exported drafter on a run's extracted samples: acc_k of each TTT step, the
figure training logs, but for the drafter as an engine loads it and on samples it may never have seen.

    python -m train.drafter_accuracy --config configs/smollm2-135m-instruct.yaml --run-dir RUN \\
        [--draft results/smollm2-135m-instruct/drafter] [--steps 7] [key=value ...]

RUN needs conversations/ and hidden/ (python -m data_gen, python -m extract; e.g. with
data_gen.prompts=<MT-Bench .jsonl> for prompts no drafter trained on); --draft defaults to RUN/drafter.
Why: training accuracy is measured on the training samples, serving acceptance on new prompts, and the two
differ by 2x in the field's common complaint. On held-out samples acc_0 says whether the drafter generalises,
and the τ it implies (1 + the sum of the cumulative products of acc_k, as if each step's accuracy held
independently) beside eval's τ says whether serving loses what the drafter knows.
"""

import argparse
import sys
from pathlib import Path

import torch

from core.drafters.drafter import Eagle3Drafter
from core.run.cli import DEFAULT_CONFIG, set_threads
from core.run.config import RunConfig, load_config
from core.run.errors import UserError
from core.storage.hidden_shards import HiddenShards, decode_hidden
from core.storage.manifest import check_compat, read_manifest
from core.target.model import load_target_embeddings, target_info
from train.data import ShardDataset, collate, precompute_teacher
from train.ttt_loss import Rows, teacher_targets, ttt_loss


@torch.no_grad()
def teacher_forced_accuracy(cfg: RunConfig, draft_dir: Path, steps: int, batch: int = 8) -> dict:
    """-> {"acc": [K] per-step accuracy over every counted row, "rows": counted rows per step, "implied_tau"}."""
    target, info = load_target_embeddings(cfg), target_info(cfg)
    drafter = Eagle3Drafter.from_pretrained(draft_dir, target.embed, info.model_type, info.num_layers).eval()
    draft_head = target.lm_head[drafter.t2d.nonzero().flatten()]
    shards, max_len = HiddenShards(cfg.run_path / "hidden"), cfg.train.max_len  # samples as training reads them
    # features of other layers or another target would score the drafter on inputs it never sees: refuse
    check_compat(read_manifest(shards.dir, "extract"), {"target": cfg.target.model,
                                                         "aux_layers": list(drafter.config.aux_layers)}, shards.dir)
    ds = ShardDataset(shards, shards.ids, max_len, precompute_teacher(shards, target.lm_head, max_len, False))
    correct, alpha, count = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    for i in range(0, len(ds), batch):
        b = decode_hidden(collate([ds[j] for j in range(i, min(i + batch, len(ds)))]), to_float=True)
        teacher = teacher_targets(b["final"], b["loss_mask"], draft_head, drafter.t2d, b["argmax"], None,
                                  b["teacher_lse"])
        _, sums = ttt_loss(drafter, Rows(b["aux"], b["input_ids"], b["loss_mask"]), teacher, steps, 1.0)
        correct, alpha, count = correct + sums["correct"], alpha + sums["alpha_sum"], count + sums["count"]
    if not count[0]:
        raise UserError(f"{shards.dir}: no sample has a trained-on token to score")
    acc, alpha = correct / count.clamp(min=1), alpha / count.clamp(min=1)
    return {"acc": acc.tolist(), "rows": count.tolist(), "implied_tau": 1 + float(torch.cumprod(acc, 0).sum()),
            "alpha": alpha.tolist(), "alpha_tau": 1 + float(torch.cumprod(alpha, 0).sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--draft", default=None, help="an SGLang-format drafter dir (default: RUN/drafter)")
    ap.add_argument("--steps", type=int, default=7, help="TTT steps K to score")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, [f"run_dir={args.run_dir}", *args.overrides])
        set_threads(cfg.threads)
        r = teacher_forced_accuracy(cfg, Path(args.draft or cfg.run_path / "drafter"), args.steps)
    except UserError as e:
        sys.stderr.write(f"drafter_accuracy: error: {e}\n")
        return 1
    sys.stdout.write(f"teacher-forced acc_k over {int(r['rows'][0]):,} rows: {' '.join(f'{a:.3f}' for a in r['acc'])}; "
                     f"implied τ at K={args.steps}: {r['implied_tau']:.3f}; alpha_k "
                     f"{' '.join(f'{a:.3f}' for a in r['alpha'])}: τ {r['alpha_tau']:.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
