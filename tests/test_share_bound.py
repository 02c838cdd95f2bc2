"""infra/share-bound.py: the effective share a screen of f candidates a prompt reaches on a pool, measured."""

import importlib.util
import itertools
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("share_bound", ROOT / "infra" / "share-bound.py")
share_bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(share_bound)


@pytest.mark.parametrize("s,r,n", [(2, 4, 2), (0, 8, 4), (3, 8, 4), (8, 8, 4), (5, 16, 4)])
def test_mixed_chance_is_the_share_of_mixed_groups_among_all_subsets(s, r, n):
    """Oracle: every n-subset of r rollouts of which s succeeded, counted; hand-worked: 2 of 4, pairs: 4 of 6."""
    rollouts = [1] * s + [0] * (r - s)
    subsets = list(itertools.combinations(rollouts, n))
    want = sum(0 < sum(c) < n for c in subsets) / len(subsets)
    assert share_bound.mixed_chance(s, r, n) == pytest.approx(want)
    assert share_bound.mixed_chance(2, 4, 2) == pytest.approx(2 / 3)
    assert math.isclose(share_bound.mixed_chance(0, r, n), 0.0, abs_tol=1e-12)


def test_the_table_rises_with_the_screens_candidates(capsys):
    """A small run on the shipped warm start: one row per f, shares in [0, 1], and a screen of 4 candidates a
    prompt keeps far more mixed groups than no screen (about 0.66 against 0.27 at full size)."""
    assert share_bound.main(["--prompts", "64", "--rollouts", "8", "--n", "4", "--need", "4", "--f", "1", "4",
                             "--draws", "40", "--max-new-tokens", "48"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ")
            or line.startswith("| 4 ")]
    assert len(rows) == 2
    (one_q, one_r), (four_q, four_r) = ((float(r[2]), float(r[3])) for r in rows)
    assert all(0 <= x <= 1 for x in (one_q, one_r, four_q, four_r))
    assert four_q > one_q + 0.15


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        share_bound.main(["--rollouts", "6", "--n", "4"])
    with pytest.raises(SystemExit):
        share_bound.main(["--prompts", "10", "--need", "4", "--f", "4"])
