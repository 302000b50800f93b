"""Keeps a local cluster's processes running: ``kvpool up`` restarts what dies.

The policy is ``kvpool.core.supervision.restart_policy`` (backoff, a start limit, the
master first); this module applies it to a started ``Cluster``. A dead
process is started again with the same arguments on the ports it had, so its
peers find it where it was: a restarted master takes the pool back from the
stores' block reports, a restarted later prefill stage makes stage 0 drop its
device cache (a device hit must hold on every stage), a restarted stage 0
checks its later stages again.

``tick`` runs on the thread that started the cluster (its children die with
the thread that started them: PR_SET_PDEATHSIG). Each death and restart is
logged and written to ``status_file`` (JSON), which the router shows in its
``/health`` detail.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from kvpool.core.supervision.restart_policy import RestartPolicy, Supervision
from kvpool.tools.cluster.launcher import Cluster
from kvpool.tools.cluster.process import ServiceFailed, ServiceProcess

log = structlog.get_logger(__name__)

_ROLE_RANK = {"master": 0, "store": 1, "decode": 2, "prefill": 3, "router": 1000}


def restart_rank(proc: ServiceProcess) -> int:
    """Master, stores, decode shards, prefill stages from the last down to stage 0, router."""
    role = proc.args[0] if proc.args else ""
    rank = _ROLE_RANK.get(role, 500)
    if role == "prefill" and "--stage" in proc.args:
        stage = int(proc.args[proc.args.index("--stage") + 1])
        rank += 100 - stage  # later stages first: stage 0 checks them
    return rank


class Supervisor:
    def __init__(self, cluster: Cluster, policy: RestartPolicy | None = None, status_file: Path | None = None,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] | None = None) -> None:
        self.cluster = cluster
        self.clock = clock
        self.status_file = status_file
        self.say = say or (lambda line: None)
        self.supervision = Supervision(policy or RestartPolicy(), {p.name: restart_rank(p) for p in cluster.services})
        self._dead: set[str] = set()
        self.write_status()

    def tick(self) -> None:
        """Notice deaths, restart what is due (blocking while each becomes ready)."""
        now = self.clock()
        for proc in self.cluster.services:
            if proc.name in self._dead or proc.proc is None or proc.alive:
                continue
            self._died(proc, f"exited with {proc.proc.returncode}", now)
        for name in self.supervision.due(self.clock()):
            proc = self.cluster.find(name)
            self.supervision.restarting(name)
            try:
                proc.restart()
            except ServiceFailed as exc:
                log.warning("service_restart_failed", service=name, error=str(exc)[-500:])
                self._died(proc, "failed to restart", self.clock())
                continue
            self._dead.discard(name)
            restarts = self.supervision.services[name].restarts
            log.warning("service_restarted", service=name, restarts=restarts, pid=proc.ready.get("pid"))
            self.say(f"kvpool up: {name} restarted (restart {restarts})")
        self.write_status()

    def rolling_restart(self, healthy: Callable[[ServiceProcess], bool], settle_timeout_s: float = 120.0,
                        stop_timeout_s: float = 30.0) -> list[str]:
        """Restart every service one at a time, each back and healthy before the next, the router last.

        A stopping service drains (not-ready, then what it holds finishes), so
        with two or more pipelines and shards no request fails: the router
        places around the one that is restarting. The router, the front door,
        is handed over instead (``hand_over_router``): its successor listens on
        the same ports before it drains. Returns the services restarted, in order.
        """
        router = self.cluster.router
        order = sorted((p for p in self.cluster.services if p is not router), key=restart_rank)
        done = []
        for proc in [*order, *([router] if router is not None else [])]:
            # never take one down while another is down or not yet back in the router's rotation (a shard
            # the supervisor just restarted is alive before the router has seen it healthy): that one first
            if not self._all_back(settle_timeout_s, healthy):
                self.say("kvpool up: rolling restart stopped: a service is down and not coming back")
                break
            if proc is router:
                if self.hand_over_router(settle_timeout_s, stop_timeout_s):
                    done.append(proc.name)
                break
            self.say(f"kvpool up: rolling restart: {proc.name}")
            try:
                proc.restart(stop_timeout_s=stop_timeout_s)
            except ServiceFailed as exc:
                # it died starting (another listener may have taken its port in the moment it was down: then
                # it is back once that one lets go): restarted as any death is, with backoff, and the rolling
                # restart goes on once it is back; it stops if it does not come back or is given up on
                log.warning("rolling_restart_start_failed", service=proc.name, error=str(exc)[-500:])
                self._died(proc, "did not start again", self.clock())
                if not self._all_back(settle_timeout_s, healthy) or self.supervision.services[proc.name].gave_up:
                    log.error("rolling_restart_failed", service=proc.name, error=str(exc)[-500:])
                    self.say(f"kvpool up: rolling restart stopped: {proc.name} did not come back "
                             f"(see {proc.log_file})")
                    break
            deadline = self.clock() + settle_timeout_s
            while not healthy(proc) and self.clock() < deadline:
                time.sleep(0.1)  # polling the router's view of health
            log.info("service_rolled", service=proc.name, healthy=healthy(proc))
            done.append(proc.name)
            self.tick()
        self.say(f"kvpool up: rolling restart done ({len(done)} of {len(order) + (router is not None)} services)")
        return done

    def hand_over_router(self, ready_timeout_s: float = 120.0, stop_timeout_s: float = 30.0) -> bool:
        """Start a second router on the router's ports, then drain the first: the front door never closes.

        Both bind with SO_REUSEPORT (``--reuse-port``), so while both run the
        kernel spreads new connections over the two; the old one then stops
        accepting and finishes its streams within its drain period, and its
        clients' next connections reach the successor. A router started
        without ``--reuse-port`` is left running (said so). True once handed over.
        """
        old = self.cluster.router
        if old is None:
            return False
        if "--reuse-port" not in old.args:
            self.say("kvpool up: rolling restart: the router was started without --reuse-port; left running")
            return False
        self.say("kvpool up: rolling restart: router (handed over to a second router on its ports)")
        new = old.successor()
        try:
            new.start()
            new.wait_ready(ready_timeout_s)
        except ServiceFailed as exc:
            new.stop()
            log.error("router_hand_over_failed", error=str(exc)[-500:])
            self.say(f"kvpool up: rolling restart: the second router did not start; the first serves on "
                     f"(see {new.log_file})")
            return False
        self.cluster.router = new  # the supervisor now watches the successor
        old.stop(stop_timeout_s)  # SIGTERM: not-ready, stop accepting, finish its streams
        log.info("service_rolled", service=old.name, pid=new.ready.get("pid"), handed_over=True)
        self.tick()
        return True

    def _all_back(self, timeout_s: float, healthy: Callable[[ServiceProcess], bool]) -> bool:
        """Tick until every service not given up on is alive and healthy again (False after ``timeout_s``)."""
        deadline = self.clock() + timeout_s
        while True:
            self.tick()
            down = [p.name for p in self.cluster.services
                    if not self.supervision.services[p.name].gave_up and not (p.alive and healthy(p))]
            if not down:
                return True
            if self.clock() >= deadline:
                log.error("rolling_restart_blocked", down=down)
                return False
            time.sleep(0.1)  # the next tick restarts what is due

    def _died(self, proc: ServiceProcess, why: str, now: float) -> None:
        self._dead.add(proc.name)
        due = self.supervision.died(proc.name, now)
        if due is None:
            policy = self.supervision.policy
            log.error("service_given_up", service=proc.name, why=why, burst=policy.burst, window_s=policy.window_s)
            self.say(f"kvpool up: {proc.name} {why}; it died more than {policy.burst} times in "
                     f"{policy.window_s:g} s: giving up on it (see {proc.log_file})")
        else:
            log.warning("service_died", service=proc.name, why=why, restart_in_s=round(due - now, 3))
            self.say(f"kvpool up: {proc.name} {why}; restarting in {due - now:.1f} s")

    def write_status(self) -> None:
        if self.status_file is None:
            return
        status = self.supervision.summary()
        for name in status:
            status[name]["alive"] = self.cluster.find(name).alive
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"services": status}))
        os.replace(tmp, self.status_file)
