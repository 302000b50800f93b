"""Old and new processes serve side by side during a rolling upgrade: the protos
stay wire-compatible with the last release's (tests/data/protos-0.1.0.binpb,
compiled from the 0.1.0 protos with grpcio-tools).

Wire-compatible here means: every field number of a released message keeps its
type and cardinality, or is reserved (never reused); enum values keep their
numbers; a method that still exists keeps its request and response types.
Fields may be added, renamed (the wire carries numbers), or removed with their
number reserved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from kvpool.rpc import decode_pb2, handoff_pb2, pool_pb2, prefill_pb2, router_pb2

RELEASED = Path(__file__).resolve().parents[1] / "data" / "protos-0.1.0.binpb"
CURRENT = (decode_pb2, handoff_pb2, pool_pb2, prefill_pb2, router_pb2)


def file_set(modules) -> dict[str, descriptor_pb2.FileDescriptorProto]:  # type: ignore[no-untyped-def]
    files = {}
    for module in modules:
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        files[proto.name] = proto
    return files


def released() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    fds = descriptor_pb2.FileDescriptorSet.FromString(RELEASED.read_bytes())
    return {f.name: f for f in fds.file if f.name.startswith("kvpool/")}


def messages(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> dict[str, descriptor_pb2.DescriptorProto]:
    out: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{message.name}"
        out[name] = message
        for nested in message.nested_type:
            walk(name, nested)

    for f in files.values():
        for m in f.message_type:
            walk(f.package, m)
    return out


def enums(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> dict[str, dict[int, str]]:
    out = {}
    for f in files.values():
        for e in f.enum_type:
            out[f"{f.package}.{e.name}"] = {v.number: v.name for v in e.value}
        for m in f.message_type:
            for e in m.enum_type:
                out[f"{f.package}.{m.name}.{e.name}"] = {v.number: v.name for v in e.value}
    return out


def incompatibilities(old: dict[str, descriptor_pb2.FileDescriptorProto],
                      new: dict[str, descriptor_pb2.FileDescriptorProto]) -> list[str]:
    problems = []
    new_messages = messages(new)
    for name, was in messages(old).items():
        now = new_messages.get(name)
        if now is None:
            problems.append(f"message {name} removed")
            continue
        fields = {f.number: f for f in now.field}
        numbers_now = {f.name: f.number for f in now.field}
        for field in was.field:
            if numbers_now.get(field.name, field.number) != field.number:
                problems.append(f"{name}.{field.name} renumbered {field.number} -> {numbers_now[field.name]}")
        reserved = [(r.start, r.end) for r in now.reserved_range]
        for field in was.field:
            current = fields.get(field.number)
            if current is None:
                if not any(lo <= field.number < hi for lo, hi in reserved):
                    problems.append(f"{name}.{field.name} = {field.number} removed without reserving its number")
                continue
            if (current.type, current.type_name, current.label) != (field.type, field.type_name, field.label):
                problems.append(f"{name} field {field.number} changed from {field.name} {field.type} "
                                f"{field.type_name} to {current.name} {current.type} {current.type_name}")
    new_enums = enums(new)
    for name, values in enums(old).items():
        now_values = new_enums.get(name)
        if now_values is None:
            problems.append(f"enum {name} removed")
            continue
        for number, value in values.items():
            if number in now_values and now_values[number] != value and not value.endswith("UNSPECIFIED"):
                # a renamed value keeps its number: compatible on the wire; a reused number is not
                if value in now_values.values():
                    problems.append(f"enum {name}: {value} renumbered")
    new_methods = {(f.package, s.name, m.name): m for f in new.values() for s in f.service for m in s.method}
    for f in old.values():
        for s in f.service:
            for m in s.method:
                now_method = new_methods.get((f.package, s.name, m.name))
                if now_method is not None and (now_method.input_type, now_method.output_type) != (
                        m.input_type, m.output_type):
                    problems.append(f"{s.name}.{m.name} changed its request or response type")
    return problems


def test_current_protos_are_wire_compatible_with_the_last_release() -> None:
    assert incompatibilities(released(), file_set(CURRENT)) == []


@pytest.mark.parametrize("breakage", ["renumber", "retype", "drop_unreserved"])
def test_the_check_finds_a_breaking_change(breakage: str) -> None:
    old = released()
    new = {k: descriptor_pb2.FileDescriptorProto.FromString(v.SerializeToString()) for k, v in old.items()}
    message = next(m for f in new.values() for m in f.message_type if len(m.field) >= 2)
    if breakage == "renumber":
        message.field[0].number, message.field[1].number = message.field[1].number, message.field[0].number
    elif breakage == "retype":
        field = message.field[0]
        field.type = (descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                      if field.type != descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                      else descriptor_pb2.FieldDescriptorProto.TYPE_INT64)
        field.type_name = ""
    else:
        del message.field[0]
    assert incompatibilities(old, new) != []


def test_a_removed_field_with_its_number_reserved_is_compatible() -> None:
    old = released()
    new = {k: descriptor_pb2.FileDescriptorProto.FromString(v.SerializeToString()) for k, v in old.items()}
    message = next(m for f in new.values() for m in f.message_type if m.field)
    number = message.field[0].number
    del message.field[0]
    message.reserved_range.add(start=number, end=number + 1)
    assert incompatibilities(old, new) == []


# What this version's services call that the last one's did not serve, and who serves what an older caller
# still sends. A rolling restart upgrades in kvpool up's order (restart_rank: master, stores, decode shards,
# stages from the last to stage 0, the router last); docs/operations.md says the same for hand-run nodes.
NEW_CALLS = {  # (callee service, method): who starts calling it, and which side must be upgraded first
    ("Decode", "Serve"): "router",  # so decode shards before the router
    ("Prefill", "Prefill"): "decode",  # by decode's Serve: stage 0 before the router (its access policy)
    # an older shard answers UNIMPLEMENTED (and ignores Serve's room_at_once: no ``reserved``, it waits for
    # room): the router then asks a shard that refused it again after its own releases and each health round
    ("Decode", "WatchRoom"): "router",
}
STILL_SERVED = {  # an older caller's calls, kept so it works beside upgraded services
    "Decode": ("Reserve", "Generate", "Landed", "ReleaseRegion"),  # an older router; older stages' Landed
    "PrefillStage": ("Restore", "HandoffDone", "Forward"),  # an older stage 0 (its restore fan-out)
}


def test_every_call_an_older_peer_makes_is_still_served_and_new_calls_come_from_later_restarts() -> None:
    from kvpool.core.tenancy.access import POLICY
    from kvpool.tools.cluster.supervisor import _ROLE_RANK

    services = {s.name: {m.name for m in s.method} for f in file_set(CURRENT).values() for s in f.service}
    for service, methods in STILL_SERVED.items():
        assert set(methods) <= services[service], service
    for (service, method), caller in NEW_CALLS.items():
        assert method in services[service]
        assert caller in POLICY[f"/kvpool.rpc.{service}/{method}"]
    # the callers of the new calls restart after what they call: the router last, decode before it
    assert _ROLE_RANK["decode"] < _ROLE_RANK["router"] and _ROLE_RANK["prefill"] < _ROLE_RANK["router"]
