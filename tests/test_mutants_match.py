"""scripts/mutants.py's mutants stay aimed at the code: each replacement matches its file exactly once and
names tests that exist. A mutant whose code has moved on cannot be applied, so it silently stops checking
anything (four had, until 2026-12-05)."""

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts/mutants.py")
mutants = importlib.util.module_from_spec(spec)
sys.modules["mutants"] = mutants  # its dataclass looks its module up there
spec.loader.exec_module(mutants)


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_matches_its_code_once_and_names_real_tests(mutant):
    source = (ROOT / mutant.file).read_text()
    assert mutant.apply(source) != source  # raises unless the replacement matches exactly once
    for test in mutant.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"{mutant.name}: no {path}"
        assert not name or f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), f"{mutant.name}: no {test}"


def test_mutant_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
