"""The goodput-under-failures model (plan/whatif/failures.py): restart-the-world against replica groups, each cost
term checked against the arithmetic done by hand, and the limits the model must meet."""

from __future__ import annotations

import pytest

from ddptrain.plan.whatif.failures import FailureCosts, replica_groups, restart_the_world

COSTS = FailureCosts(step_s=1.0, checkpoint_every_s=1800.0, save_s=10.0, restart_s=300.0, detect_s=10.0,
                     group_restart_s=60.0, heal_s=20.0, step_overhead=0.02)


def test_each_policys_lost_time_is_its_terms_done_by_hand() -> None:
    world = restart_the_world(COSTS, failures_per_hour=1.0)
    assert world.lost == pytest.approx({"checkpoint saves": 10 / 1810, "restarts": 300 / 3600,
                                        "redone work": 900 / 3600})
    assert world.goodput == pytest.approx(1 - 10 / 1810 - 1200 / 3600)
    groups = replica_groups(COSTS, failures_per_hour=1.0, groups=8)
    # every GPU loses the step in flight and the detection; only the failed group (1/8) its restart and heal
    assert groups.lost == pytest.approx({"checkpoint saves": 10 / 1810, "quorum per step": 0.02 / 1.02,
                                         "detection": 11 / 3600, "group restarts": 80 / 3600 / 8})
    assert groups.goodput == pytest.approx(1 - 10 / 1810 - 0.02 / 1.02 - 11 / 3600 - 10 / 3600)


def test_without_failures_only_the_steady_costs_remain() -> None:
    assert restart_the_world(COSTS, 0.0).goodput == pytest.approx(1 - 10 / 1810)
    assert replica_groups(COSTS, 0.0, 4).goodput == pytest.approx(1 - 10 / 1810 - 0.02 / 1.02)


def test_more_groups_lose_less_and_the_group_restart_is_what_they_share() -> None:
    by_groups = [replica_groups(COSTS, 2.0, r).goodput for r in (2, 4, 16, 256)]
    assert by_groups == sorted(by_groups) and len(set(by_groups)) == 4
    slower_heal = FailureCosts(**{**vars(COSTS), "heal_s": 200.0})
    assert replica_groups(slower_heal, 2.0, 4).goodput < replica_groups(COSTS, 2.0, 4).goodput
    # restart-the-world does not depend on the group's costs, and replica groups not on the world's restart
    assert restart_the_world(slower_heal, 2.0) == restart_the_world(COSTS, 2.0)
    slower_world = FailureCosts(**{**vars(COSTS), "restart_s": 900.0})
    assert replica_groups(slower_world, 2.0, 4) == replica_groups(COSTS, 2.0, 4)
    assert restart_the_world(slower_world, 2.0).goodput < restart_the_world(COSTS, 2.0).goodput


def test_a_failure_rate_beyond_what_the_restarts_allow_is_zero_not_negative() -> None:
    # 10 an hour: the world redoes 10 x 1,200 s an hour; the groups lose 10 x (11 + 80 / 2) s an hour
    assert restart_the_world(COSTS, 10.0).goodput == 0.0
    assert replica_groups(COSTS, 10.0, 2).goodput == pytest.approx(1 - 10 / 1810 - 0.02 / 1.02 - 510 / 3600)
    assert replica_groups(COSTS, 100.0, 2).goodput == 0.0


@pytest.mark.parametrize(("field", "value"), [("restart_s", -1.0), ("step_s", 0.0), ("checkpoint_every_s", 0.0)])
def test_impossible_costs_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        FailureCosts(**{**vars(COSTS), field: value})


def test_one_group_is_not_replica_groups() -> None:
    with pytest.raises(ValueError, match="groups=1"):
        replica_groups(COSTS, 1.0, 1)
