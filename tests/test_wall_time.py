"""WallTime: laps make the phases, steps inside a phase are disjoint, and the timing's
counters are split by phase."""

import time

from qdq_optuna.wall_time import WallTime


def test_nested_steps_count_once_and_laps_split_the_counters():
    counters = {"loads": 0, "load_s": 0.0}
    wall = WallTime(counters=lambda: dict(counters))
    with wall.step("starts", "repair"):
        time.sleep(0.05)
        with wall.step("starts", "timing"):  # a repaired start's timing, inside the repair
            time.sleep(0.1)
            counters["loads"] += 3
    wall.lap("starts")
    counters["loads"] += 2
    wall.lap("descent")
    d = wall.to_dict()
    steps = d["starts"]["steps"]
    # a loaded machine only lengthens a sleep: the lower bounds are what is checked
    assert 0.09 <= steps["timing"] < 1.0 and 0.04 <= steps["repair"] < steps["timing"] + 0.5
    # each figure is rounded on its own: the sum may pass the rounded total by a rounding step each
    assert sum(steps.values()) <= d["starts"]["seconds"] + 0.005 * (len(steps) + 1)
    assert d["starts"]["timing"]["loads"] == 3 and d["descent"]["timing"]["loads"] == 2
    assert list(d) == ["starts", "descent"]
