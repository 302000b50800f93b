"""The ``kvpool`` command: one subcommand per role, plus tools and benchmarks.

It lives with the services because it is what starts them: the library in
``kvpool/`` never imports ``services/``. Its parser is
``services/cli_parser.py``; this module runs what was parsed: a role (its
settings, its TLS identity, the bind shim, then its serve function) or a tool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvpool import tracing
from kvpool.logs import configure_logging
from kvpool.settings import load_settings
from kvpool.tools.bench.cli import run_bench
from kvpool.services.cli_parser import ROLES, build_parser, load_reference


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if v is not None}


def _log(args: argparse.Namespace) -> None:
    fmt = getattr(args, "log_format", "auto")
    # kvpool up's flag defaults to None (see services_log_level): up itself logs at info then
    configure_logging(getattr(args, "log_level", "warning") or "info", json=None if fmt == "auto" else fmt == "json")


def _settings(cls: type, section: str, args: argparse.Namespace) -> Any:
    try:
        return load_settings(cls, section, args.config, _flags(args))
    except (ValueError, TypeError) as exc:
        # bad settings: say which, no traceback
        raise SystemExit(f"kvpool {section}: {exc}") from None


def _engine_binds_only(transfer_host: str) -> None:
    """Before anything starts: the transfer engine may listen on ``transfer_host`` only (kvpool/bind_shim.py)."""
    from kvpool import bind_shim

    try:
        bind_shim.exec_with_shim(transfer_host, ["-m", "kvpool.services.cli", *sys.argv[1:]])
    except (ValueError, bind_shim.ShimUnavailable) as exc:
        raise SystemExit(f"kvpool: {exc}") from None


def _secure(args: argparse.Namespace, settings: Any) -> None:
    """Configure this process's TLS identity; plaintext (or a keyless HTTP API) beyond loopback needs --insecure."""
    from kvpool import tls

    security = _settings(tls.SecuritySettings, "security", args)
    hosts = [settings.host, getattr(settings, "transfer_host", "")]
    try:
        tls.refuse_plaintext_off_loopback(security, hosts, f"kvpool {args.command}")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.command == "router" and not security.insecure and not tls.is_loopback(settings.host):
        if not (settings.api_keys_file or os.environ.get("KVPOOL_API_KEY")):
            raise SystemExit(f"kvpool router: the HTTP API listens on {settings.host} without API keys: give "
                             "--api-keys-file or KVPOOL_API_KEY, or --insecure to serve it open anyway")
    try:
        tls.configure(security)
    except ValueError as exc:
        raise SystemExit(f"kvpool {args.command}: {exc}") from None


def _run_role(args: argparse.Namespace) -> int:
    role = ROLES[args.command]
    if getattr(args, "api_key", None):  # the router's: declared only to be refused (a usage error)
        from kvpool.services.router.settings import COMMAND_LINE_KEY

        print(f"kvpool {args.command}: --api-key is refused: {COMMAND_LINE_KEY}", file=sys.stderr)
        return 2
    otlp = getattr(args, "otlp_endpoint", None)
    if otlp:  # read by kvpool.tracing on the first traced call
        os.environ[tracing.OTLP_ENV] = otlp
    tracing.set_service_name(f"kvpool-{args.command}")
    settings = _settings(load_reference(role.settings), args.command, args)
    _secure(args, settings)
    if role.owns_transfer_engine:
        _engine_binds_only(settings.transfer_host)
    serve = load_reference(role.serve)
    from kvpool import service

    service.run(lambda: serve(settings, args.ready_file))
    _exit_closed(0)


def _exit_closed(code: int) -> NoReturn:
    """Leave a service process whose serve() has returned, skipping the interpreter's teardown.

    By then the service has closed all it owns: its servers stopped, saves drained, channels and the
    transfer engine closed, files written in ``with`` blocks. What is left is unloading torch and the
    engine's extension, which cost about 0.9 s of CPU per process and held every restart of a rolling
    restart and every stop of ``kvpool up`` for it. Logs are flushed first.
    """
    tracing.flush()  # the spans of the last calls, still in their batch
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _run_up(args: argparse.Namespace) -> int:
    from kvpool.tools.up import API_KEY_ENV, UpSettings, run_up

    if args.api_key_on_command_line is not None:
        print("kvpool up: --api-key is refused: any local user reads a process's command line "
              f"(/proc/PID/cmdline); give the keys in a file, --api-keys-file PATH (mode 0600, a line KEY or "
              f"TENANT=KEY each), or in ${API_KEY_ENV}", file=sys.stderr)
        return 2
    settings = _settings(UpSettings, "up", args)
    if getattr(args, "otlp_endpoint", None):  # every service started here inherits it (kvpool.tracing)
        os.environ[tracing.OTLP_ENV] = args.otlp_endpoint
    demo = None
    if args.demo or args.trace:
        from kvpool.tools.demo import DemoSettings, default_trace, run_demo

        trace = "" if args.trace == "synthetic" else (args.trace or default_trace())
        demo_settings = DemoSettings(trace=trace, scale=args.scale, turns=args.turns)
        if settings.device_cache_tokens is None:
            # one session's history fits the device, two do not: revisits come from the pool
            from kvpool.model import get_config
            from kvpool.model.hf_checkpoint import checked_model_dir
            from kvpool.tools.demo import demo_device_cache_tokens

            config = checked_model_dir(settings.model_dir).config if settings.model_dir else get_config(settings.model)
            settings.device_cache_tokens = demo_device_cache_tokens(demo_settings, config.vocab_size)

        def play(cluster: Any) -> int:
            if cluster.access.api_keys:  # the demo's client sends the first key (this process's environment only)
                os.environ[API_KEY_ENV] = cluster.access.api_keys[0]
            return run_demo(cluster.http_url, demo_settings)

        demo = play
    from kvpool.services.memory_budget import memory_budget

    return run_up(settings, args.config, services_log_level(args), demo, memory_budget(settings, args.config),
                  args.ready_file)


def _run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "master-core":  # the master's servicer in this process: it lives with the master
        from kvpool.services.master.core_bench import main as bench_master_core

        return bench_master_core(args)
    return run_bench(args)


def services_log_level(args: argparse.Namespace) -> str:
    """The level ``kvpool up`` gives the services it starts: warning unless ``--log-level`` was given (so
    ``--log-level info`` gets their info lines, where the default keeps the terminal and files quiet)."""
    return args.log_level or "warning"


def _run_generate(args: argparse.Namespace) -> int:
    from kvpool.tools.clients import generate

    return asyncio.run(generate(args.router, args.prompt, args.max_tokens, args.temperature, args.session))


def _run_chat(args: argparse.Namespace) -> int:
    from kvpool.tools.clients import chat

    return chat(args.url, args.max_tokens, args.temperature)


def _run_health(args: argparse.Namespace) -> int:
    from kvpool.tools.health import check

    return check(args.address, args.timeout)


def _run_certs(args: argparse.Namespace) -> int:
    import datetime
    from pathlib import Path

    from kvpool.tools.certs import write_compose_credentials

    from kvpool.secret_files import UnsafeFolder, private_folder

    folder = Path(args.folder)
    if args.days < 1:
        raise SystemExit("kvpool certs: --days must be at least 1")
    try:
        private_folder(folder, "certs folder")
    except UnsafeFolder as exc:
        raise SystemExit(f"kvpool certs: {exc}") from None
    if (folder / "ca.pem").exists() and not args.force:
        raise SystemExit(f"kvpool certs: {folder} already holds credentials (a running cluster uses them): "
                         "--force replaces them")
    identities = write_compose_credentials(folder, tuple(args.host), datetime.timedelta(days=args.days))
    print(f"kvpool certs: a CA and {len(identities)} certificates in {folder}/<service>/, valid {args.days} days; "
          f"the API key is in {folder}/client/api_key; a metrics scraper uses {folder}/monitor/")
    return 0


def _run_pool(args: argparse.Namespace) -> int:
    from kvpool.pool.stats import format_stats
    from kvpool.pool.stats_client import fetch_stats

    stats = asyncio.run(fetch_stats(args.master))
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    from kvpool.tools.replay.cli import main as replay

    return replay(args)


def _run_simulate(args: argparse.Namespace) -> int:
    from kvpool.tools.sim.cli import main as simulate

    return simulate(args)


def _run_report(args: argparse.Namespace) -> int:
    from kvpool.tools.report import main as report
    from kvpool.tools.report_tables import TABLES

    return report(args, TABLES)


def _die_with_parent_if_asked() -> None:
    """SIGTERM when the process that started us goes (``kvpool up``'s children: no orphans)."""
    from kvpool.tools.cluster import PARENT_PID_ENV

    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):
        raise SystemExit("kvpool: the process that started this one is gone")  # it died before the prctl


def main(argv: Sequence[str] | None = None) -> int:
    _die_with_parent_if_asked()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    _log(args)
    handlers = {
        **dict.fromkeys(ROLES, _run_role), "up": _run_up, "generate": _run_generate, "chat": _run_chat,
        "health": _run_health, "certs": _run_certs,
        "pool": _run_pool, "bench": _run_bench, "replay": _run_replay, "simulate": _run_simulate,
        "report": _run_report,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
