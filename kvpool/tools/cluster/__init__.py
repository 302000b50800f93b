"""The one cluster launcher: a topology as data, started as real ``kvpool <role>`` processes.

``topology`` describes what runs (servers, masters, stores, pipelines and
their stages, decode shards, the router, a network namespace per server);
``launcher.Cluster`` starts and stops it; ``process.ServiceProcess`` is one
process (the only code that runs ``python -m kvpool.services.cli``); ``parts`` holds
a pool, a pipeline or a decode shard on its own; ``netns`` the per-server
network namespaces and shaped links; ``supervisor`` restarts what dies.
"""

from __future__ import annotations

from kvpool.tools.cluster.launcher import Cluster, Server
from kvpool.tools.cluster.parts import LocalDecode, LocalPipeline, LocalPool
from kvpool.tools.cluster.process import PARENT_PID_ENV, ServiceFailed, ServiceProcess
from kvpool.tools.cluster.topology import (
    DecodeSpec,
    MasterSpec,
    PipelineSpec,
    RouterSpec,
    ServerSpec,
    StoreSpec,
    Topology,
)

__all__ = [
    "PARENT_PID_ENV",
    "Cluster",
    "DecodeSpec",
    "LocalDecode",
    "LocalPipeline",
    "LocalPool",
    "MasterSpec",
    "PipelineSpec",
    "RouterSpec",
    "Server",
    "ServerSpec",
    "ServiceFailed",
    "ServiceProcess",
    "StoreSpec",
    "Topology",
]
