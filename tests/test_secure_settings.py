"""SessionSettings and ClientSettings: each side's tuning of the secure channel, checked once."""

from __future__ import annotations

import dataclasses

import pytest

from cumulus_p2p.channel.secure import SessionSettings
from cumulus_p2p.channel.secure.client import connect_secure
from cumulus_p2p.channel.secure.libp2p_path import connect_secure_libp2p
from cumulus_p2p.channel.secure.record import RECORD_LIMIT


def test_settings_are_frozen():
    settings = SessionSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.grace_period = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "field",
    [
        {"max_record": 0},
        {"max_record": RECORD_LIMIT + 1},
        {"max_frame": 0},
        {"rekey_bytes": 0},
        {"max_unacked": -1},
        {"handshake_timeout": 0},
        {"grace_period": -1},
        {"grace_period": float("nan")},
    ],
)
def test_settings_out_of_range_are_refused_on_construction(field):
    with pytest.raises(ValueError, match=next(iter(field))):
        SessionSettings(**field)


def test_a_session_with_no_grace_period_is_allowed():
    assert SessionSettings(grace_period=0).grace_period == 0


def test_settings_survive_a_handover_state():
    settings = SessionSettings(max_record=64 * 1024, grace_period=5.0, handshake_timeout=2.0)
    assert SessionSettings.from_state(settings.as_state()) == settings


def test_a_state_with_unknown_settings_is_refused():
    with pytest.raises(ValueError, match="not session settings"):
        SessionSettings.from_state({"grace_period": 1.0, "window": 3})


def test_the_core_takes_the_limits_and_not_the_timeouts():
    limits = SessionSettings(max_frame=1 << 20).core_limits
    assert limits == {
        "max_frame": 1 << 20,
        "max_record": SessionSettings().max_record,
        "rekey_bytes": SessionSettings().rekey_bytes,
        "max_unacked": SessionSettings().max_unacked,
    }


@pytest.mark.parametrize("connect", [connect_secure, connect_secure_libp2p])
def test_a_misspelled_consumer_tuning_keyword_is_refused_before_anything_is_dialed(connect):
    address = ("127.0.0.1", 9) if connect is connect_secure else ("/ip4/127.0.0.1/tcp/9",)
    with pytest.raises(TypeError, match="max_recrod"):
        connect(*address, identity=None, expected_peer_public_key=b"", max_recrod=1)
