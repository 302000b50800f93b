"""The ``kvpool`` command's parser: a subcommand per role, its flags derived from the role's settings
dataclass, plus the tools' and benchmarks' subcommands.

The roles (``ROLES``) name their settings class and serve function by
reference, imported only when that subcommand is parsed or run, and
``build_parser`` builds only the flags of the command being run: a role
starting up skips the tools' imports and every other command's flag tables.
Running the parsed command is ``services/cli.py``'s.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any

from kvpool.settings import add_setting_flags
from kvpool.tools.bench.cli import add_bench
from kvpool.tools.command_flags import add_log_level_flag


def _security_flags(parser: argparse.ArgumentParser) -> None:
    """The [security] table's flags (kvpool/tls.py): this process's certificate, the CA, plaintext consent."""
    group = parser.add_argument_group("security", "mutual TLS for gRPC; also the [security] table of --config")
    group.add_argument("--tls-ca", dest="ca", metavar="FILE", help="the cluster CA (PEM; default $KVPOOL_TLS_CA)")
    group.add_argument("--tls-cert", dest="cert", metavar="FILE",
                       help="this process's certificate, its common name its role (default $KVPOOL_TLS_CERT)")
    group.add_argument("--tls-key", dest="key", metavar="FILE", help="its private key (default $KVPOOL_TLS_KEY)")
    group.add_argument("--insecure", action="store_true", default=None,
                       help="serve plaintext gRPC (and, for the router, HTTP without keys) beyond loopback anyway")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML", help="settings file; its [<role>] table is read, flags win")
    add_log_level_flag(parser, "info")
    parser.add_argument(
        "--log-format", default="auto", choices=["auto", "json", "console"],
        help="auto: JSON unless stderr is a terminal",
    )
    parser.add_argument("--ready-file", metavar="PATH", help="write bound ports as JSON here once serving")
    parser.add_argument(
        "--otlp-endpoint", metavar="HOST:PORT",
        help="export traces (a span per call of each request) to this OpenTelemetry collector over OTLP/gRPC "
        "(https://HOST:PORT for TLS); default $KVPOOL_OTLP_ENDPOINT, else no tracing",
    )


@dataclass(frozen=True, slots=True)
class Role:
    """One role's subcommand. ``settings`` and ``serve`` are ``module:name`` references, imported only when
    that subcommand is parsed or run (a master never imports torch)."""

    settings: str
    serve: str
    help: str
    description: str
    owns_transfer_engine: bool = False  # re-executed under the bind shim before it starts (kvpool/bind_shim.py)


ROLES: dict[str, Role] = {
    "master": Role("kvpool.services.master.settings:MasterSettings", "kvpool.services.master.server:serve",
                   "run the pool master", "Run the pool master: object locations, group-LRU eviction, leases, "
                   "store liveness."),
    "store": Role("kvpool.services.store.settings:StoreSettings", "kvpool.services.store.daemon:serve",
                  "run a store daemon", "Run a store daemon: one DRAM segment pinned to a NUMA node, registered "
                  "with the transfer engine and mounted on the master.", owns_transfer_engine=True),
    "prefill": Role("kvpool.services.prefill.settings:PrefillSettings", "kvpool.services.prefill.server:serve",
                    "run a prefill pipeline stage", "Run one prefill pipeline stage: a contiguous range of layers "
                    "and their device KV pages. Stage 0 also runs the scheduler (chunk hashing, the shared block "
                    "table, device → pool → compute planning) and serves the Prefill API. Start the later stages "
                    "first.", owns_transfer_engine=True),
    "decode": Role("kvpool.services.decode.settings:DecodeSettings", "kvpool.services.decode.server:serve",
                   "run a decode shard", "Run a decode shard: the whole model over token-major KV pages, "
                   "continuous batching, sampling and token streaming; receive regions for the prefill handoff.",
                   owns_transfer_engine=True),
    "router": Role("kvpool.services.router.settings:RouterSettings", "kvpool.services.router.server:serve",
                   "run the router (gRPC Generate and the OpenAI-compatible HTTP API)", "Run the router: the front "
                   "door. It places each request on a prefill pipeline (the session's own while its queue is "
                   "short) and the decode shard with the most free KV pages, and serves gRPC Generate and the "
                   "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health; "
                   "/metrics on the admin port)."),
}


def load_reference(reference: str) -> Any:
    """The object a ``module:name`` reference names, its module imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def _add_role(sub: Any, name: str, role: Role) -> None:
    p = sub.add_parser(name, help=role.help, description=role.description)
    _common(p)
    add_setting_flags(p, load_reference(role.settings))
    _security_flags(p)
    if name == "prefill":
        p.add_argument("--no-pool", dest="master", action="store_const", const="",
                       help="run without the pool: device cache only")


def _add_up(sub: Any) -> None:
    from kvpool.tools.up import UpSettings

    p = sub.add_parser("up", help="run a whole cluster on this host",
                       description="Start a whole cluster on this host — master, stores, prefill pipelines, decode "
                       "shards and the router with the OpenAI-compatible HTTP API — wait until every service is "
                       "healthy, print where each listens, and stop them all on Ctrl-C or SIGTERM. Its shape comes "
                       "from the [up] table of --config (every service also reads its own table), flags win.")
    _common(p)
    # not given: up logs at info and the services it starts at warning; given: both at that level
    p.set_defaults(log_level=None)
    add_setting_flags(p, UpSettings)
    # refused by services/cli.py with the reason: named here so that it is not taken for --api-keys-file
    p.add_argument("--api-key", dest="api_key_on_command_line", metavar="KEY", help=argparse.SUPPRESS)
    p.add_argument("--demo", action="store_true",
                   help="play one coding-agent session turn by turn through the HTTP API, print the figures, stop")
    p.add_argument("--trace", metavar="FILE", help="with --demo: a weka-format session file, or 'synthetic' for a "
                   "built-in session shaped like the real traces (default: the first real session when "
                   "../shared/traces/agentx-weka lies beside the checkout, else synthetic)")
    p.add_argument("--turns", type=int, default=6, help="with --demo: turns each session plays (default 6)")
    p.add_argument("--scale", type=int, default=16, help="with --demo: token scale factor (default 16)")


def _add_clients(sub: Any) -> None:
    gen = sub.add_parser("generate", help="one completion from a running cluster",
                         description="Send one prompt to a running cluster's router (gRPC) and stream the answer.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--router", default="127.0.0.1:7900", help="router gRPC address (default 127.0.0.1:7900)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--session", default="", help="session key (keeps the session's history hot)")
    add_log_level_flag(gen, "warning")
    chat = sub.add_parser("chat", help="an interactive chat with a running cluster",
                          description="A small interactive client: each line you type is a user turn; the "
                          "conversation is resent every turn, as agents do, under one session key.")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="router HTTP URL (default http://127.0.0.1:8000)")
    chat.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    add_log_level_flag(chat, "warning")
    health = sub.add_parser("health", help="is a service serving? (exit 0: yes)",
                            description="Ask one service whether it is serving: a host:port asks its gRPC health "
                            "service, an http:// URL asks for a 200 (the router's /health). Exit 0 when serving, "
                            "1 otherwise, with the reason on stderr: a container or unit health check.")
    health.add_argument("address", help="host:port of a gRPC service, or a URL such as http://127.0.0.1:8000/health")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")


def _add_certs(sub: Any) -> None:
    p = sub.add_parser("certs", help="credentials for compose.yaml's cluster: a CA, one certificate per service, "
                       "an API key", description="Write a new throwaway CA and, for each of compose.yaml's services "
                       "and an operator's client, a folder of its own: ca.pem, cert.pem and key.pem (its common "
                       "name its role), which compose mounts read-only into that container only. The router's "
                       "folder also holds the API keys file, the client's the key to send (api_key).")
    p.add_argument("folder", help="where to write them (compose.yaml mounts ./deploy/compose/tls)")
    p.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="a further address the certificates are valid for (always: 127.0.0.1, ::1, localhost)")
    p.add_argument("--days", type=int, default=90, help="how long they stay valid (default 90)")
    p.add_argument("--force", action="store_true", help="replace credentials already in the folder")


def _add_pool(sub: Any) -> None:
    p = sub.add_parser("pool", help="inspect the pool")
    pool_sub = p.add_subparsers(dest="pool_command", required=True)
    stats = pool_sub.add_parser("stats", help="capacity, use, objects, groups, evictions, per segment")
    stats.add_argument("--master", default="127.0.0.1:7601", help="pool master address")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_replay(sub: Any) -> None:
    from kvpool.tools.replay.cli import add_replay_parser

    add_replay_parser(sub)


def _add_report(sub: Any) -> None:
    from kvpool.tools.report import add_report_parser

    add_report_parser(sub)


def _add_simulate(sub: Any) -> None:
    from kvpool.tools.sim.cli import add_simulate_parser

    add_simulate_parser(sub)


# every command but the roles, by the function that adds its parser (one adds three)
_ADDERS: dict[str, Any] = {
    "up": _add_up, "generate": _add_clients, "chat": _add_clients, "health": _add_clients, "certs": _add_certs,
    "pool": _add_pool,
    "bench": add_bench, "replay": _add_replay, "simulate": _add_simulate, "report": _add_report,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole ``kvpool`` parser; given a known ``command``, only that command's flags are built and the
    others are bare names: a role starting up skips the tools' imports (cryptography, httpx, ...) and the
    flag tables of every other command, about a second of CPU per process on a loaded host."""
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: disaggregated LLM serving around one shared KV-cache pool in host memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [*ROLES, *_ADDERS]
    wanted = _ADDERS.get(command or "", command)  # the adder of a tool, the name of a role
    built: set[str] = set()
    for name in names:
        if name in built:
            continue
        if command in names and _ADDERS.get(name, name) != wanted:
            sub.add_parser(name)  # its name only: argparse still knows every command
            continue
        before = set(sub.choices)
        if name in ROLES:
            _add_role(sub, name, ROLES[name])
        else:
            _ADDERS[name](sub)
        built |= set(sub.choices) - before
    return parser
