"""The standby between hosts that serve only over the secure channel, as market hosts do.

A host pulling another's kept pieces opens a secure channel to it with a key made for the
connection and the grant its consumer gave it: admitted to read those pieces, nothing
else. Hosts are real ``cumulus-executor --secure`` processes; "vanishing" is SIGKILL.
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack, contextmanager

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import SessionRefusedError
from cumulus_p2p.blobs.service import HELLO, ONLY_BLOBS, Source, grant_of, reader_token
from cumulus_p2p.blobs.standby import HostCheckpoint
from cumulus_p2p.channel.secure import connect_secure
from cumulus_p2p.channel.transport import CountingFrameChannel
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.testing import models
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

# Starts several executor processes.
pytestmark = pytest.mark.slow

CONSUMER = NodeIdentity.generate()


@contextmanager
def secure_host(tmp_path, name: str):
    """A secure executor that serves ``CONSUMER``, with a blob store; yields
    ``(connect, process)``, ``connect()`` opening a channel to it as the consumer that
    names where other hosts reach it."""
    flags = ["--secure", "--data-dir", str(tmp_path / name), "--blob-dir", str(tmp_path / name)]
    flags += ["--allow-key", CONSUMER.public_key.hex()]
    with executor_process(quota="2GiB", extra=flags) as (address, proc):
        host, port = address.split(":")

        def connect():
            channel = connect_secure(
                host,
                int(port),
                identity=CONSUMER,
                expected_peer_public_key=proc.provider_key,
                resume_timeout=1.0,  # a killed host counts as gone after a second
            )
            where = Source.secure_address(proc.provider_key, address)
            return CountingFrameChannel(channel, lambda n: None, peer_address=where)

        yield connect, proc


def reader(connect_to, grant: str):
    """A secure channel to a host as another host reading by ``grant``."""
    where = connect_to().peer_address
    key, _, address = where.rpartition("@")
    host, port = address.split(":")
    return connect_secure(
        host,
        int(port),
        identity=NodeIdentity.generate(),
        expected_peer_public_key=bytes.fromhex(key),
        lease=reader_token(grant),
    )


def test_secure_hosts_copy_a_checkpoint_and_restore_it_after_the_primary_is_killed(tmp_path):
    with ExitStack() as hosts:
        primary, primary_proc = hosts.enter_context(secure_host(tmp_path, "primary"))
        standby, _ = hosts.enter_context(secure_host(tmp_path, "standby"))
        fresh, _ = hosts.enter_context(secure_host(tmp_path, "fresh"))
        with remote.attach(channel=fresh()):  # the uninterrupted run, on the same kind of host
            expected = models.train("transformer", "cumulus", steps=6)
        with remote.attach(channel=primary(), reconnect=fresh, standby=standby()) as session:

            def on_step(i: int) -> None:
                if i == 2:
                    assert isinstance(session.checkpoint(), HostCheckpoint)
                if i == 4:
                    primary_proc.kill()
                    primary_proc.wait()

            got = models.train("transformer", "cumulus", steps=6, on_step=on_step)
            stats = session.failover_statistics()
    assert got[0] == expected[0]
    for name, value in expected[1].items():
        assert torch.equal(got[1][name], value), name
    assert stats.cold_restores == 1 and stats.replicated_checkpoints == 1
    assert stats.checkpoint_read_bytes == 0
    assert stats.restore_pulled_bytes == stats.checkpoint_bytes


def test_a_secure_host_refuses_a_reader_whose_grant_no_session_holds(tmp_path):
    with secure_host(tmp_path, "host") as (connect, _):
        with pytest.raises(SessionRefusedError, match="no session here keeps pieces"):
            reader(connect, secrets.token_hex(32))


def test_a_reader_admitted_by_a_grant_can_read_but_not_open_a_session(tmp_path):
    with secure_host(tmp_path, "host") as (connect, _):
        with remote.attach(channel=connect()) as session:
            grant = grant_of(session.info["token"])
            channel = reader(connect, grant)
            channel.send_frame(encode_frame([HELLO, PROTOCOL_VERSION, {"grant": grant}]))
            assert decode_frame(channel.recv_frame())[0] == ["ready"]
            channel.close()

            channel = reader(connect, grant)
            channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {}]))
            header, _ = decode_frame(channel.recv_frame())
            assert header == ["fatal", ONLY_BLOBS]
            channel.close()
            assert torch.ones(2).to("cumulus").cpu().tolist() == [1.0, 1.0]  # it serves on
