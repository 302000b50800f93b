"""Topologies as data: the shapes kvpool up and replay --compare ask for, and the checks on a topology."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.tools.cluster import PipelineSpec, ServerSpec, StoreSpec, Topology
from kvpool.tools.cluster.topology import decode_topology, pipeline_topology, pool_topology
from kvpool.tools.replay.compare import side_settings
from kvpool.tools.replay.topology import AFFINITY_STRICT, TopologySettings, side_topology
from kvpool.tools.up import UpSettings, store_numa_nodes, up_topology
from kvpool.host_numa import numa_nodes


def test_kvpool_up_default_shape(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"  # up reads the roles' tables: a file it is given must exist
    config.write_text("")
    topology = up_topology(UpSettings(), config=str(config), log_level="info")
    assert topology.names == ("master", "router", "store0", "store1", "decode0",
                              "p0-stage0", "p0-stage1", "p0-stage2", "p0-stage3")
    assert topology.common_args == ("--log-level", "info", "--log-format", "json", "--config", str(config))
    assert topology.router is not None and (topology.router.port, topology.router.http_port) == (7900, 8000)
    [server] = topology.servers
    node = str(store_numa_nodes(2, numa_nodes())[1])  # "0" on a one-node host
    assert server.stores[1].args == ("--segment-size", "512MiB", "--numa-node", node, "--segment-id", "up-store1",
                                     "--no-transfer-engine")
    assert server.pipelines[0].pool and not topology.netns and topology.die_with_parent


def test_kvpool_up_runs_no_transfer_engine_unless_asked() -> None:
    # one host: shared memory carries every bulk byte, so no store, stage or decode shard opens an engine port
    [server] = up_topology(UpSettings()).servers
    engines = [*server.stores, *server.pipelines, *server.decode_shards]
    assert all("--no-transfer-engine" in spec.args for spec in engines)
    [server] = up_topology(UpSettings(transfer_engine=True)).servers
    assert not any("--no-transfer-engine" in spec.args for spec in [*server.stores, *server.pipelines,
                                                                      *server.decode_shards])


def test_kvpool_up_puts_stores_on_the_nodes_with_cpus_round_robin() -> None:
    two = {0: [0, 1], 1: [2, 3]}
    assert store_numa_nodes(4, two) == [0, 1, 0, 1]
    assert store_numa_nodes(2, {0: [0, 1], 1: [], 2: [4]}) == [0, 2]  # node 1 is memory-only
    assert store_numa_nodes(3, {0: [0]}) == [0, 0, 0]
    assert store_numa_nodes(0, two) == []


def test_kvpool_up_leaves_the_node_to_a_store_table_that_names_it(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[store]\nnuma_node = 1\n")
    [server] = up_topology(UpSettings(), config=str(config)).servers
    assert all("--numa-node" not in store.args for store in server.stores)


def test_kvpool_up_hands_tenant_weights_to_the_master_and_every_stage() -> None:
    topology = up_topology(UpSettings(tenant_weights="alice=3,bob=1", stages=2))  # type: ignore[arg-type]
    assert topology.master is not None and topology.master.args == ("--tenant-weights", "alice=3,bob=1")
    [pipeline] = topology.servers[0].pipelines
    assert pipeline.args[-2:] == ("--tenant-weights", "alice=3,bob=1")
    assert up_topology(UpSettings()).master.args == ()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="tenant_weights"):
        UpSettings(tenant_weights=["alice=0"])


def test_kvpool_up_without_a_pool_starts_no_master_and_no_store() -> None:
    topology = up_topology(UpSettings(stores=0, pipelines=2, stages=1, decode_shards=2))
    assert topology.master is None
    assert topology.names == ("router", "decode0", "decode1", "p0-stage0", "p1-stage0")
    assert [p.pool for p in topology.servers[0].pipelines] == [False, False]


def test_compare_sides_shared_and_split() -> None:
    shared = side_topology(TopologySettings(servers=2, stages=1, pool="shared"))
    assert shared.names == ("master", "router", "s0-store-p", "s0-store-d", "s0-decode", "s0-stage0",
                            "s1-store-p", "s1-store-d", "s1-decode", "s1-stage0")
    assert [s.host_name for s in shared.servers] == ["kvr-s0", "kvr-s1"] and shared.netns
    split = side_topology(TopologySettings(servers=2, stages=1, pool="split", eviction="object"))
    assert split.master is None
    assert split.names == ("router", "s0-master", "s0-store-p", "s0-decode", "s0-stage0",
                           "s1-master", "s1-store-p", "s1-decode", "s1-stage0")
    assert split.servers[1].master is not None and split.servers[1].master.args == ("--eviction", "object")


def test_compare_split_baselines_differ_only_in_the_routers_affinity() -> None:
    """split-strict: the router never moves a session off its pipeline; split-moving: the router's own default."""
    base = TopologySettings(servers=2, stages=1)
    strict = side_topology(side_settings(base, "pool", "split-strict"))
    moving = side_topology(side_settings(base, "pool", "split-moving"))
    assert strict.router is not None and moving.router is not None
    args = list(strict.router.args)
    assert args[args.index("--affinity-max-queue") + 1] == str(AFFINITY_STRICT)
    assert "--affinity-max-queue" not in moving.router.args
    assert strict.names == moving.names and strict.master is None and moving.master is None
    shared = side_settings(base, "pool", "shared")
    assert (shared.pool, shared.affinity_max_queue) == ("shared", 0)
    with pytest.raises(ValueError, match="affinity_max_queue must be >= 0"):
        TopologySettings(affinity_max_queue=-1)


def test_one_part_topologies() -> None:
    assert pool_topology(2, "8MiB").names == ("master", "store0", "store1")
    assert pipeline_topology(2, "").names == ("stage0", "stage1")
    assert pipeline_topology(2, "").servers[0].pipelines[0].pool is False
    assert pipeline_topology(1, "127.0.0.1:7601").master_address == "127.0.0.1:7601"
    assert decode_topology("d", ("--num-pages", "8")).names == ("d",)
    assert not pool_topology(1, "8MiB").die_with_parent


@pytest.mark.parametrize(("topology", "message"), [
    (lambda: Topology(()), "at least one"),
    (lambda: Topology((ServerSpec(stores=(StoreSpec("s"),)),)), "without a master"),
    (lambda: Topology((ServerSpec(pipelines=(PipelineSpec(),)),)), "without a master"),
    (lambda: Topology((ServerSpec(pipelines=(PipelineSpec(stages=0, pool=False),)),)), "stages"),
    (lambda: Topology((ServerSpec(stores=(StoreSpec("a"), StoreSpec("a"))),), master_address="m:1"), "unique"),
    (lambda: Topology((ServerSpec(),), netns=True), "host_name"),
])
def test_bad_topologies_are_refused(topology, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        topology()


def test_a_child_inherits_no_tls_identity_from_its_launcher(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a bench or tool with KVPOOL_TLS_* of its own starts plaintext children; kvpool up --secure passes flags
    from kvpool.tools.cluster.process import PARENT_PID_ENV, ServiceProcess

    parent = {"KVPOOL_TLS_CA": "/ca.pem", "KVPOOL_TLS_CERT": "/c.pem", "KVPOOL_TLS_KEY": "/k.pem",
              PARENT_PID_ENV: "1", "HOME": "/root"}
    env = ServiceProcess("master", ["master"], tmp_path).child_env(parent)
    assert env == {"HOME": "/root", "PYTHONUNBUFFERED": "1"}
    assert parent["KVPOOL_TLS_CA"] == "/ca.pem"  # the launcher's own identity is untouched
