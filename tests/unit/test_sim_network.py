"""The prices of sharing, exactly: NIC bandwidth shared by the transfers in flight, a master's FIFO queue."""

from __future__ import annotations

import pytest

from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.network import MasterQueue, Network


def test_two_transfers_share_the_sending_nic_equally() -> None:
    loop, landed = EventLoop(), []
    net = Network(loop, nic_bytes_per_s=100.0)
    net.send("s0", "s1", 100, lambda: landed.append(("a", loop.now)))
    net.send("s0", "s2", 100, lambda: landed.append(("b", loop.now)))
    loop.run(10.0)
    # 50 B/s each on s0's NIC: both land at 2 s
    assert landed == [("a", pytest.approx(2.0)), ("b", pytest.approx(2.0))]
    assert net.nic_bytes == {"s0": 200.0, "s1": 100.0, "s2": 100.0}


def test_a_transfer_speeds_up_when_its_neighbour_lands() -> None:
    loop, landed = EventLoop(), []
    net = Network(loop, nic_bytes_per_s=100.0)
    net.send("s0", "s1", 100, lambda: landed.append(("a", loop.now)))
    loop.at(0.5, net.send, "s2", "s1", 100, lambda: landed.append(("b", loop.now)))
    loop.run(10.0)
    # a alone for 0.5 s (50 B), then both at 50 B/s on s1's NIC: a's last 50 B by 1.5 s;
    # b moved 50 B by then and takes the NIC alone: its last 50 B by 2.0 s
    assert landed == [("a", pytest.approx(1.5)), ("b", pytest.approx(2.0))]


def test_a_transfer_within_a_server_takes_no_nic() -> None:
    loop, landed = EventLoop(), []
    net = Network(loop, nic_bytes_per_s=100.0)
    net.send("s0", "s0", 1_000, lambda: landed.append(loop.now))
    loop.run(10.0)
    assert landed == [0.0] and net.nic_bytes == {}


def test_the_master_serves_one_operation_at_a_time_in_order() -> None:
    loop, served = EventLoop(), []
    master = MasterQueue(loop)
    master.call(0.3, served.append, "lookup")
    master.call(0.2, served.append, "put")
    loop.at(1.0, master.call, 0.1, served.append, "late")
    times = []
    loop.at(0.0, lambda: times.append(master.wait_s()))
    loop.run(5.0)
    assert served == ["lookup", "put", "late"]
    assert master.busy_s == pytest.approx(0.6) and master.num_ops == 3
    assert times == [pytest.approx(0.5)]  # queued at 0: 0.3 + 0.2 s of work ahead
    assert (master.counted_busy_s, master.counted_ops) == (pytest.approx(0.6), 3)  # counted from 0


def test_the_master_counts_apart_what_is_queued_after_warm_up() -> None:
    loop = EventLoop()
    master = MasterQueue(loop, counted_from_s=1.0)
    master.call(0.5, lambda: None)
    loop.at(0.9, master.call, 0.25, lambda: None)
    loop.at(1.0, master.call, 0.125, lambda: None)  # queued at warm-up's end: counted
    loop.at(3.0, master.call, 0.0625, lambda: None)
    loop.run(5.0)
    assert (master.busy_s, master.num_ops) == (0.9375, 4)
    assert (master.counted_busy_s, master.counted_ops) == (0.1875, 2)
