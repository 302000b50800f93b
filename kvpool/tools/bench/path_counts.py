"""A request's control RPCs, counted from the RPC trace (``kvpool.tracing``: its spans, one JSON line each): how many calls it made and
how many awaited round trips came before its first token. Pure: lines in, figures out.

- ``rpcs_per_request``: every traced call made for the request, at any time,
  saves included (``save_rpcs`` counts those apart), leaving out the entry call
  (the client's ``Router/Generate``, when traced under the same id);
  ``round_trips_per_request`` counts each call's awaited answers instead (at
  least one a call), so a stream that carries several exchanges is not one.
- ``critical_path``: the longest chain of awaited round trips before the first
  token. The trace is a tree (each call names its caller's span; a call made by
  a task its handler started names that handler, even when it runs after the
  handler returned). A call counts its awaited answers before the first token
  (at least one) plus its children's longest chain: children that ran one after
  another add up, children that overlapped (a fan-out to every stage) count as
  the deepest of them. A call follows a chain of its siblings when its caller
  sent it (``sent``, by the caller's clock: a fan-out's calls all go out before
  any answer, though their servers may start them one after another) after
  every call on that chain, nested ones included, had answered. Only calls that started before the first token count,
  and not the saves, which run beside the request, nor a call made from a task
  nobody waits for (``detached`` in the trace: a lease's release). A stage writing
  decode's region by the engine (another host) makes ``Decode/Landed`` calls (a
  check before each write, an announce after it) one after another, so they
  chain, though they overlap the later pieces' compute; on decode's host a stage
  makes none.
- ``depth_beyond_stage_hops``: the depth less the N−1 hops of the forward chain
  of N stages, which no design can remove.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

PACKAGE = "/kvpool.rpc."
ENTRY_METHOD = "/kvpool.rpc.Router/Generate"
# the saves: beside the request, never on its way to the first token
SAVE_METHODS = frozenset({"/kvpool.rpc.PrefillStage/SaveDone", "/kvpool.rpc.PoolMaster/PutStart",
                          "/kvpool.rpc.PoolMaster/PutEnd", "/kvpool.rpc.PoolMaster/PutRevoke"})

Call = dict[str, Any]


def _answers_before(call: Call, first_token_at: float) -> int:
    """The call's awaited round trips before the first token: at least one (its start came before it)."""
    answers = call.get("answers", [call["end"]])
    return max(1, sum(1 for t in answers if t <= first_token_at))


def _sent(call: Call) -> float:
    """When the caller opened the call (the server's start in a trace without it)."""
    return float(call.get("sent", call["start"]))


def _without_entry(calls: list[Call]) -> list[Call]:
    return [c for c in calls if not (c["method"] == ENTRY_METHOD and c["parent"] not in {x["span"] for x in calls})]


def critical_path(calls: list[Call], first_token_at: float) -> list[str]:
    """The awaited round trips of the longest chain before the first token, in the order they started, each a
    method (``Service/Method``); a call with several awaited answers on the chain appears once per answer."""
    kept = [c for c in calls if c["start"] < first_token_at and c["method"] not in SAVE_METHODS
            and not c.get("detached")]
    spans = {c["span"] for c in kept}
    children: dict[str, list[Call]] = {}
    for c in kept:
        children.setdefault(c["parent"] if c["parent"] in spans else "", []).append(c)

    def chain(siblings: list[Call]) -> list[Call]:
        ordered = sorted(siblings, key=_sent)
        best = [nested(c) for c in ordered]
        for j, c in enumerate(ordered):
            for i in range(j):  # c follows the chain to i once all of that chain's calls had answered
                if max(x["end"] for x in best[i]) <= _sent(c) and len(best[i]) + len(nested(c)) > len(best[j]):
                    best[j] = best[i] + nested(c)
        return max(best, key=len, default=[])

    def nested(call: Call) -> list[Call]:
        return [call] * _answers_before(call, first_token_at) + chain(children.get(call["span"], []))

    roots = children.get("", [])
    if len(roots) == 1 and roots[0]["method"] == ENTRY_METHOD:
        path = chain(children.get(roots[0]["span"], []))  # the client's own call is the entry, not a hop
    else:
        path = chain(roots)
    return [c["method"].removeprefix(PACKAGE) for c in sorted(path, key=_sent)]


def request_counts(calls: list[Call], first_token_at: float, stages: int) -> dict[str, Any]:
    """One request's figures (see the module doc) from its trace lines."""
    made = _without_entry(calls)
    path = critical_path(calls, first_token_at)
    return {
        "rpcs_per_request": len(made),
        "save_rpcs": sum(1 for c in made if c["method"] in SAVE_METHODS),
        "round_trips_per_request": sum(max(1, len(c.get("answers", [c["end"]]))) for c in made),
        "critical_path_depth": len(path),
        "depth_beyond_stage_hops": len(path) - (stages - 1),
        "critical_path": path,
        "rpcs_by_method": dict(sorted(Counter(c["method"].removeprefix(PACKAGE) for c in made).items())),
    }
