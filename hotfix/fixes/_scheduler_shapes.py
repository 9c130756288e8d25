"""Known shapes of the ``Scheduler`` methods several fixes wrap (one list to extend per
release, so the fixes cannot drift apart)."""
from __future__ import annotations

from hotfix.registry import Shape

UPDATE_FROM_OUTPUT = {
    "0c4d8106750d2ea2": Shape("0.27.0-0.27.1"), "3a952ef59c38a3a4": Shape("0.28.0"),
    "8df892460283ad44": Shape("0.29.0"), "23fcfb3d9c376cee": Shape("0.30.0"),
    "79e6face830f7fb1": Shape("0.31.0-0.32.0"), "cbfde91b6fe16ae7": Shape("0.33.0"),
    "1b9d5a0935389e77": Shape("0.34.0"),
}
HAS_REQUESTS = {"c8820a96bd59eaaa": Shape("0.27.0-0.34.0")}
