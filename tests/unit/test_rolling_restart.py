"""The rolling restart's order: never take a service down while another is not back in rotation.

The supervisor drives the launcher's process objects; here they are small
stand-ins that record what was restarted and report health as the router
would, so the order can be checked exactly and without timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.tools.cluster.process import ServiceFailed
from kvpool.tools.cluster.supervisor import Supervisor


@dataclass
class Proc:
    name: str
    args: list[str]
    restarted: list[str]  # the cluster's record of restarts, in order
    alive: bool = True
    proc: object = "started"  # the supervisor only asks whether there is one
    log_file: str = ""
    ready: dict = field(default_factory=dict)

    def restart(self, timeout_s: float = 120.0, stop_timeout_s: float = 10.0) -> dict:
        self.restarted.append(self.name)
        self.alive = True
        return self.ready


@dataclass
class Cluster:
    members: list[Proc]
    router: Proc

    @property
    def services(self) -> list[Proc]:
        """As the launcher's: the router last, whichever router it is now."""
        return [p for p in self.members if p.name != "router"] + [self.router]

    def find(self, name: str) -> Proc:
        return next(p for p in self.services if p.name == name)


def master_two_shards_router() -> tuple[Cluster, Proc, Proc, list[str]]:
    restarted: list[str] = []
    router = Proc("router", ["router"], restarted)
    d0, d1 = Proc("decode0", ["decode"], restarted), Proc("decode1", ["decode"], restarted)
    return Cluster([Proc("master", ["master"], restarted), d0, d1, router], router), d0, d1, restarted


def ticking(step_s: float) -> Callable[[], float]:
    now = [0.0]

    def clock() -> float:
        now[0] += step_s
        return now[0]
    return clock


def test_a_shard_alive_but_not_yet_healthy_is_waited_for_before_the_next_goes_down() -> None:
    cluster, d0, d1, restarted = master_two_shards_router()
    # decode1 was restarted a moment ago: alive, but the router has not seen it healthy for a few polls
    polls_until_d1_healthy = [5]

    def healthy(p: Proc) -> bool:
        if p is d1 and polls_until_d1_healthy[0] > 0:
            polls_until_d1_healthy[0] -= 1
            return False
        return p.alive

    order_seen: list[tuple[str, bool]] = []
    original = d0.restart

    def d0_restart(timeout_s: float = 120.0, stop_timeout_s: float = 10.0) -> dict:
        order_seen.append(("decode0", healthy(d1)))
        return original(timeout_s, stop_timeout_s)

    d0.restart = d0_restart  # type: ignore[method-assign]
    sup = Supervisor(cluster, clock=ticking(0.05))  # type: ignore[arg-type]
    done = sup.rolling_restart(healthy, settle_timeout_s=10.0)
    assert done == ["master", "decode0", "decode1"] == restarted
    assert order_seen == [("decode0", True)]  # decode1 was back in rotation before decode0 went down


def test_a_service_never_healthy_stops_the_rolling_restart() -> None:
    cluster, _, d1, restarted = master_two_shards_router()
    said: list[str] = []
    sup = Supervisor(cluster, clock=ticking(1.0), say=said.append)  # type: ignore[arg-type]
    done = sup.rolling_restart(lambda p: p is not d1 and p.alive, settle_timeout_s=5.0)
    assert done == []  # decode1 never in rotation: nothing else may be taken down
    assert restarted == []
    assert any("a service is down and not coming back" in line for line in said)


@dataclass
class Router(Proc):
    """A router stand-in: its successor is another stand-in on the same ports; every step is recorded."""

    events: list[str] = field(default_factory=list)
    generation: int = 0

    def successor(self) -> Router:
        self.events.append(f"router{self.generation + 1} made")
        return Router(self.name, list(self.args), self.restarted, alive=False, events=self.events,
                      generation=self.generation + 1)

    def start(self) -> None:
        self.events.append(f"router{self.generation} started")
        self.alive = True

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        self.events.append(f"router{self.generation} ready")
        return self.ready

    def stop(self, timeout_s: float = 10.0) -> int:
        self.events.append(f"router{self.generation} stopped")
        self.alive = False
        return 0


def test_the_router_is_handed_over_last_its_successor_listening_before_it_drains() -> None:
    restarted: list[str] = []
    router = Router("router", ["router", "--reuse-port"], restarted)
    d0 = Proc("decode0", ["decode"], restarted)
    cluster = Cluster([Proc("master", ["master"], restarted), d0, router], router)
    said: list[str] = []
    sup = Supervisor(cluster, clock=ticking(0.05), say=said.append)  # type: ignore[arg-type]
    done = sup.rolling_restart(lambda p: p.alive, settle_timeout_s=10.0)
    assert done == ["master", "decode0", "router"]
    assert restarted == ["master", "decode0"]  # the router is never restarted in place
    assert router.events == ["router1 made", "router1 started", "router1 ready", "router0 stopped"]
    assert cluster.router is not router and cluster.router.alive and not router.alive
    assert said[-1] == "kvpool up: rolling restart done (3 of 3 services)"


def test_a_router_without_reuse_port_is_left_running() -> None:
    restarted: list[str] = []
    router = Router("router", ["router"], restarted)
    cluster = Cluster([Proc("master", ["master"], restarted), router], router)
    said: list[str] = []
    done = Supervisor(cluster, clock=ticking(0.05), say=said.append).rolling_restart(  # type: ignore[arg-type]
        lambda p: p.alive, settle_timeout_s=10.0)
    assert done == ["master"] and router.events == [] and cluster.router is router
    assert "started without --reuse-port; left running" in said[-2]
    assert said[-1] == "kvpool up: rolling restart done (1 of 2 services)"


@dataclass
class Unlucky(Proc):
    """A service whose first ``failures`` starts fail (its port held by another listener a while)."""

    failures: int = 1

    def restart(self, timeout_s: float = 120.0, stop_timeout_s: float = 10.0) -> dict:
        self.restarted.append(self.name)
        if self.failures > 0:
            self.failures -= 1
            self.alive = False
            raise ServiceFailed(f"{self.name} exited with 1 before it was ready: Failed to bind")
        self.alive = True
        return self.ready


def rolling_with_an_unlucky_master(failures: int, step_s: float, settle_timeout_s: float
                                   ) -> tuple[Supervisor, list[str], list[str], list[str]]:
    """A rolling restart of a master whose first ``failures`` starts fail, a decode shard and a router: the
    supervisor, the services done, those restarted in order, and what it said."""
    restarted: list[str] = []
    router = Proc("router", ["router"], restarted)
    master = Unlucky("master", ["master"], restarted, failures=failures)
    cluster = Cluster([master, Proc("decode0", ["decode"], restarted), router], router)
    said: list[str] = []
    sup = Supervisor(cluster, clock=ticking(step_s), say=said.append)  # type: ignore[arg-type]
    done = sup.rolling_restart(lambda p: p.alive, settle_timeout_s=settle_timeout_s)
    return sup, done, restarted, said


def test_a_service_that_fails_to_start_again_is_restarted_with_backoff_and_the_rolling_restart_goes_on() -> None:
    sup, done, restarted, said = rolling_with_an_unlucky_master(failures=2, step_s=0.05, settle_timeout_s=30.0)
    assert done == ["master", "decode0"]  # (a router without --reuse-port is left running)
    assert restarted == ["master", "master", "master", "decode0"]  # the rolling one, then two by the supervisor
    assert any("master did not start again; restarting in" in line for line in said)
    assert not any("rolling restart stopped" in line for line in said)
    assert sup.supervision.services["master"].restarts == 2


def test_a_service_that_never_starts_again_stops_the_rolling_restart_once_given_up() -> None:
    sup, done, restarted, said = rolling_with_an_unlucky_master(failures=1000, step_s=0.5, settle_timeout_s=600.0)
    assert done == [] and "decode0" not in restarted  # nothing else is taken down
    assert sup.supervision.services["master"].gave_up
    assert any("giving up on it" in line for line in said)
    assert said[-1] == "kvpool up: rolling restart done (0 of 3 services)"
    assert any("rolling restart stopped: master did not come back" in line for line in said)
