"""``kvpool replay --chaos SPEC``: parsed exactly, every bad part named."""

from __future__ import annotations

import pytest

from kvpool.core.supervision.chaos_spec import ChaosSpecError, Fault, FaultKind, check_targets, parse_chaos, parse_duration

ISSUE_SPEC = ("kill:store0@30s,kill:master@60s,kill:p1-stage2@90s,kill:decode1@120s,"
              "slow:store1=200ms@150s,corrupt:store0@180s")


def test_the_issues_spec() -> None:
    assert parse_chaos(ISSUE_SPEC) == [
        Fault(FaultKind.KILL, "store0", 30.0),
        Fault(FaultKind.KILL, "master", 60.0),
        Fault(FaultKind.KILL, "p1-stage2", 90.0),
        Fault(FaultKind.KILL, "decode1", 120.0),
        Fault(FaultKind.SLOW, "store1", 150.0, 0.2),
        Fault(FaultKind.CORRUPT, "store0", 180.0),
    ]
    assert [f.label for f in parse_chaos(ISSUE_SPEC)] == ISSUE_SPEC.split(",")


def test_time_order_and_units() -> None:
    faults = parse_chaos(" kill:decode0@2m , kill:router@1.5s,kill:master@500ms")
    assert [(f.target, f.at_s) for f in faults] == [("master", 0.5), ("router", 1.5), ("decode0", 120.0)]
    assert parse_duration("250ms") == 0.25 and parse_duration("3s") == 3.0
    with pytest.raises(ValueError, match="duration"):
        parse_duration("3h")


@pytest.mark.parametrize(("spec", "part", "why"), [
    ("", "", "empty"),
    ("kill:store0@30s,,kill:master@60s", "", "empty fault"),
    ("kill:store0", "kill:store0", "no time"),
    ("kill:store0@soon", "kill:store0@soon", "time:"),
    ("store0@30s", "store0@30s", "no kind"),
    ("explode:store0@30s", "explode:store0@30s", "kind 'explode'"),
    ("kill:store@30s", "kill:store@30s", "target 'store'"),
    ("kill:master@30s,kill:p1stage2@90s", "kill:p1stage2@90s", "target 'p1stage2'"),
    ("slow:store1@150s", "slow:store1@150s", "needs its delay"),
    ("slow:store1=fast@150s", "slow:store1=fast@150s", "delay:"),
    ("slow:store1=0ms@150s", "slow:store1=0ms@150s", "more than 0"),
    ("kill:store1=5ms@150s", "kill:store1=5ms@150s", "takes no '='"),
    ("corrupt:decode0@10s", "corrupt:decode0@10s", "store only"),
    ("slow:master=1s@10s", "slow:master=1s@10s", "store only"),
])
def test_a_bad_spec_names_its_part(spec: str, part: str, why: str) -> None:
    with pytest.raises(ChaosSpecError) as info:
        parse_chaos(spec)
    assert str(info.value).startswith(f"chaos: {part!r}: ")
    assert why in str(info.value)
    assert info.value.field == "chaos"


def test_targets_must_be_the_clusters() -> None:
    names = {"master", "store0", "store1", "decode0", "p0-stage0", "p0-stage1", "router"}
    check_targets(parse_chaos("kill:store1@1s,kill:p0-stage1@2s"), names)
    with pytest.raises(ChaosSpecError, match=r"'kill:p1-stage2@90s': no process 'p1-stage2' in this cluster"):
        check_targets(parse_chaos("kill:store1@1s,kill:p1-stage2@90s"), names)
