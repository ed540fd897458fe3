"""CUDA's one-kernel head-loss terms (train/head_loss_kernel.py) against `chunk_terms`, run by Triton's
interpreter on the CPU, for each train.loss (kl, lk_alpha, lk_lambda) with a pruned vocab's mass. In a subprocess: the interpreter is chosen when the kernel is defined, from
TRITON_INTERPRET, so this process's imports must not decide it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import json, sys
import torch
from train.draft_head_loss import chunk_terms
from train.loss_kind import HeadLoss
from train.head_loss_kernel import BLOCK, fused_chunk_terms

torch.manual_seed(0)
out = []
# a row shorter than one block, rows over several blocks with a ragged end, fp32 and bf16
for c, vd, n_teacher, dtype in [(5, 300, 9, torch.float32), (6, 2 * BLOCK + 77, 11, torch.bfloat16),
                                (4, 3 * BLOCK, 4, torch.float32)]:
    z = (torch.randn(c, vd) * 3).to(dtype)
    p = torch.softmax(torch.randn(n_teacher, vd) * 2, -1).to(dtype)
    p[1] = 0  # a teacher row with no mass (sum(p) = 0): gradient softmax * 0 - 0
    rows = torch.randint(0, n_teacher, (c,))
    rows[1] = 1
    top = torch.randint(0, vd, (n_teacher,))
    top[rows[0]] = z[0].float().argmax()  # at least one right answer
    if vd > BLOCK:  # equal maxima in two blocks: torch.argmax takes the first, so must the kernel
        z[2] = z[2].clamp(max=5)
        z[2, 3], z[2, BLOCK + 5] = 9.0, 9.0
        top[rows[2]] = 3
    scale = torch.rand(c) + 0.1
    mass = torch.rand(n_teacher) * 0.5 + 0.5
    for loss in (HeadLoss("kl"), HeadLoss("lk_alpha"), HeadLoss("lk_lambda", 0.9, 3.0)):
        ref, got = chunk_terms(z, p, top, rows, scale, mass, loss), fused_chunk_terms(z, p, top, rows, scale, mass, loss)
        out.append({"dtype": str(dtype), "vd": vd, "loss_kind": loss.kind,
                    "loss": (ref[0] - got[0]).abs().max().item() / ref[0].abs().max().item(),
                    "alpha": (ref[2] - got[2]).abs().max().item(),
                    "right_ref": ref[1].tolist(), "right": got[1].tolist(),
                    "g": ((ref[3].float() - got[3].float()).abs() / ref[3].float().abs().max()).max().item(),
                    "g_ulps": ((ref[3].float() - got[3].float()).abs() > 2 ** -7 * ref[3].float().abs() + 1e-9).sum().item(),
                    "g_dtype": str(got[3].dtype), "argmax_tie": vd > BLOCK and bool(got[1][2])})
print(json.dumps(out))
"""


def test_one_kernel_terms_equal_chunk_terms_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(cases) == 9 and {c["loss_kind"] for c in cases} == {"kl", "lk_alpha", "lk_lambda"}
    for case in cases:
        assert case["loss"] < 1e-5 and case["alpha"] < 1e-5, case
        assert case["right"] == case["right_ref"] and any(case["right"]), case
        assert case["g_dtype"] == case["dtype"], case
        assert case["g"] < 1e-5 if case["dtype"] == "torch.float32" else case["g_ulps"] == 0, case  # bf16: <= 1 ulp
    assert all(c["argmax_tie"] for c in cases[3:])
