"""bench/ab_pairs.py's arithmetic: figure names from a run's JSON and the bootstrap interval."""

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import ab_pairs  # noqa: E402


def test_figures_names_every_row_and_lookup():
    run = {"rows": [{"tier": "disk", "transport": "shm", "clients": 1, "op": "get", "gbps": 4.2,
                     "baseline": "file read", "ratio_slots": 1.9}],
           "lookup_ms": {"local paced": {"p50": 0.15}}}
    assert ab_pairs.figures(run) == {"disk shm 1c get GB/s": 4.2, "disk shm 1c get vs file read": 1.9,
                                     "lookup local paced p50 ms": 0.15}


def test_bootstrap_interval_holds_the_median_and_narrows_with_pairs():
    rng = random.Random(7)
    few = [rng.lognormvariate(0, 0.15) for _ in range(6)]
    many = few + [rng.lognormvariate(0, 0.15) for _ in range(60)]
    low, high = ab_pairs.bootstrap_median(few)
    assert low <= statistics.median(few) <= high
    low_many, high_many = ab_pairs.bootstrap_median(many)
    assert low_many <= statistics.median(many) <= high_many
    assert high_many - low_many < high - low
    assert ab_pairs.bootstrap_median([1.25] * 5) == (1.25, 1.25)
