"""A pytest plugin: under ``pytest -n N --dist loadgroup``, the longest work starts first.

pytest-xdist hands out work units (a test, or all the tests of one ``xdist_group``) in the order it has them, and a
run ends when its slowest worker ends. Left to collection order (or to xdist's own reordering, by the number of tests
in a unit), a 70-second CLI test collected last starts when the other worker has nothing left, and the run waits for
it alone. Handing out the longest units first (the "longest processing time first" rule) leaves only short tests
for the end, where they fill both workers evenly.

How long a unit takes is estimated from a committed table, ``tests/data/test_seconds.json`` (written by
``scripts/bench_tests.py --seconds`` from a ``--timing-json`` run's figures): the tests measured long, by id, and each
file's mean per test and tier for the rest; a file the table does not know counts ``UNKNOWN_S`` per test. The table
only orders work: a stale one costs time, never a test.

The order is made on each worker, at collection, the same on all of them (xdist refuses workers whose collections
differ), and xdist's own reordering is turned off so that it hands the units out in that order. Without xdist the
order stays the collection's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.timing import tier
from tests.helpers.xdist_groups import explicit_groups

TABLE = Path(__file__).parents[1] / "data" / "test_seconds.json"
UNKNOWN_S = 0.5  # a test of a file the table has not seen: about the fast tier's mean


def load_table(path: Path = TABLE) -> dict[str, dict[str, float]]:
    """``{"tests": {id: s}, "files": {"path::tier": mean s per test}}``; empty when there is no table."""
    if not path.is_file():
        return {"tests": {}, "files": {}}
    table = json.loads(path.read_text())
    return {"tests": table.get("tests", {}), "files": table.get("files", {})}


def estimate_s(nodeid: str, tier_name: str, table: dict[str, dict[str, float]]) -> float:
    """Seconds one test is expected to take: its own figure, else its file's mean in its tier, else ``UNKNOWN_S``."""
    if nodeid in table["tests"]:
        return table["tests"][nodeid]
    return table["files"].get(f"{nodeid.split('::')[0]}::{tier_name}", UNKNOWN_S)


def longest_first(items: list[pytest.Item], table: dict[str, dict[str, float]]) -> list[pytest.Item]:
    """``items`` as work units (an ``xdist_group`` is one unit, any other test its own), the longest unit first;
    each unit's tests stay together and in their order; ties keep the collection's order."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups = sorted(explicit_groups(item))
        units.setdefault(f"group {'_'.join(groups)}" if groups else item.nodeid, []).append(item)

    def unit_s(tests: list[pytest.Item]) -> float:
        return sum(estimate_s(t.nodeid, tier(t), table) for t in tests)

    ordered = sorted(units.values(), key=unit_s, reverse=True)  # sorted() is stable: ties keep their order
    return [item for unit in ordered for item in unit]


def pytest_configure(config: pytest.Config) -> None:
    # the controller hands out units in the workers' collection order, which longest_first made
    if getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after xdist_groups has marked the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    items[:] = longest_first(items, load_table())
