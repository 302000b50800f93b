"""A master's standby settings and the small parsers around etcd: each bad value refused naming its field."""

from __future__ import annotations

import grpc
import pytest

from kvpool.ha.etcd_client import check_endpoint, prefix_end
from kvpool.ha.master_link import epoch_of, etcd_of
from kvpool.services.master.settings import MasterSettings
from kvpool.services.store.settings import StoreSettings


def test_a_master_without_etcd_is_the_one_master() -> None:
    settings = MasterSettings()
    assert settings.etcd == "" and settings.advertise == ""


def test_a_master_with_etcd_gets_lease_times_that_cannot_flap_or_overlap() -> None:
    times = MasterSettings(etcd="127.0.0.1:2379").lease_times()
    assert (times.ttl_s, times.keepalive_s, times.margin_s) == (2.0, 0.4, 0.3)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"etcd": "localhost"}, "etcd"), ({"etcd": "h:99999"}, "etcd"), ({"etcd": ":2379"}, "etcd"),
    ({"etcd": "h:2379", "lease_ttl_s": 0.5}, "lease_ttl_s"),
    ({"etcd": "h:2379", "lease_keepalive_s": 1.0}, "lease_keepalive_s"),
    ({"etcd": "h:2379", "lease_margin_s": 1.5}, "lease_margin_s"),
    ({"etcd": "h:2379", "commit_timeout_s": 0}, "commit_timeout_s"),
    ({"etcd": "h:2379", "adoption_grace_s": -1}, "adoption_grace_s"),
    ({"advertise": "nohost"}, "advertise"),
])
def test_bad_standby_settings_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        MasterSettings(**kwargs)  # type: ignore[arg-type]


def test_endpoints_drop_the_scheme_etcd_prints() -> None:
    assert check_endpoint("http://10.0.0.9:2379/") == "10.0.0.9:2379"
    assert check_endpoint("https://[::1]:2379") == "[::1]:2379"


def test_a_prefix_range_ends_past_every_key_that_starts_with_it() -> None:
    assert prefix_end(b"/kvpool/stores/") == b"/kvpool/stores0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_a_store_follows_etcd_only_when_its_master_says_etcd() -> None:
    assert etcd_of(StoreSettings().master) is None
    assert etcd_of("etcd://10.0.0.9:2379") == "10.0.0.9:2379"
    with pytest.raises(ValueError, match="^master: "):
        etcd_of("etcd://nowhere")


def test_a_reply_without_an_epoch_is_epoch_zero() -> None:
    assert epoch_of(grpc.aio.Metadata(("kvpool-epoch", "42"))) == 42
    assert epoch_of(grpc.aio.Metadata(("kvpool-epoch", "x"))) == 0
    assert epoch_of(None) == 0 and epoch_of(()) == 0
