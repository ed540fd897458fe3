"""scripts/mutants.py's mutants stay aimed at the code: each replacement matches its file exactly once, names
tests that exist and has a name of its own. A mutant whose code has moved on cannot be applied, so it would
silently stop checking anything."""

import subprocess
import sys

from tests.conftest import ROOT


def test_every_mutant_matches_its_code_once_and_names_real_tests():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/mutants.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("mutants aimed at their code")
