"""A pytest plugin: under ``pytest -n N --dist loadgroup``, tests that share a module- or class-scoped fixture run
on one worker, so the fixture's work (a shared training run, a built model) happens once, not once per worker.

pytest-xdist hands out tests one by one; a module fixture is set up by every worker that runs one of its tests.
Here the tests are joined through the fixtures they share (and the ``xdist_group`` marks they carry) and every test
of a joined set gets one ``xdist_group`` mark, which ``--dist loadgroup`` sends to a single worker. Tests that share
nothing stay free to go anywhere. Session-scoped fixtures do not join tests (they would join most of the suite):
an expensive one keeps its result across workers itself (``tests/helpers/run_cache.py``).

pytest-xdist 3.8 writes a test's group into its node id as ``<id>@<group>`` (what ``loadgroup`` schedules by), through
an attribute pytest 9 no longer reads: there the marks alone group nothing and tests that share a fixture are
spread over the workers anyway. ``pytest_collection_finish`` below then writes the suffix itself, through
pytest 9's node id; under a pytest or xdist that does it, it finds the suffix there and changes nothing.

A test carries its own ``xdist_group`` mark only where tests must not run at the same time as each other (timing
checks); its joined set takes that name. Two such names in one set are refused at collection: the set would have
to run on two workers at once.
"""

from __future__ import annotations

import pytest

JOINING_SCOPES = ("module", "class", "package")


class _Sets:
    """Union-find over names: tests, fixture instances and explicit groups."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        self.parent.setdefault(name, name)
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The module/class/package-scoped fixtures ``item`` uses, each named by where it is defined."""
    info = getattr(item, "_fixtureinfo", None)  # pytest keeps the resolved fixture definitions here
    if info is None:
        return []
    return [f"fixture {defs[-1].baseid}::{name}" for name, defs in info.name2fixturedefs.items()
            if defs and defs[-1].scope in JOINING_SCOPES]


def explicit_groups(item: pytest.Item) -> set[str]:
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}


def assign_groups(items: list[pytest.Item]) -> dict[str, str]:
    """nodeid -> the group its joined set runs in (only for tests that share something)."""
    sets = _Sets()
    for item in items:
        for shared in shared_fixtures(item):
            sets.join(item.nodeid, shared)
        for group in explicit_groups(item):
            sets.join(item.nodeid, f"group {group}")
    members: dict[str, list[pytest.Item]] = {}
    for item in items:
        members.setdefault(sets.find(item.nodeid), []).append(item)
    named: dict[str, str] = {}
    for root, tests in members.items():
        if len(tests) == 1 and not explicit_groups(tests[0]):
            continue
        explicit = sorted({g for t in tests for g in explicit_groups(t)})
        if len(explicit) > 1:
            raise pytest.UsageError(f"tests marked into xdist groups {explicit} share a module fixture: one group each "
                                    f"(e.g. {tests[0].nodeid})")
        name = explicit[0] if explicit else f"shared:{tests[0].nodeid.split('::')[0]}:{root.rsplit('::', 1)[-1]}"
        named.update({t.nodeid: name for t in tests})
    return named


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = assign_groups(items)
    for item in items:
        group = groups.get(item.nodeid)
        if group is not None and group not in explicit_groups(item):
            item.add_marker(pytest.mark.xdist_group(group))


def group_suffix(item: pytest.Item) -> str | None:
    names = sorted(explicit_groups(item))
    return f"@{'_'.join(names)}" if names else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist sends the collected ids to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    if not getattr(session.config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    for item in session.items:
        suffix = group_suffix(item)
        if suffix is not None and not item.nodeid.endswith(suffix):
            from _pytest.nodeid import NodeId  # pytest >= 9: the id is this object, not a string attribute

            item._id = NodeId.parse(item.nodeid + suffix)  # type: ignore[attr-defined]
