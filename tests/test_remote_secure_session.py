"""The cumulus device over the secure channel: allow lists, and training through a blip."""

from __future__ import annotations

import socket
import tempfile

import pytest
import torch

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import SessionRefusedError
from cumulus_p2p.channel.secure import connect_secure
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.models import train

CONSUMER = NodeIdentity.generate()


@pytest.fixture(scope="module")
def secure_executor():
    with tempfile.TemporaryDirectory() as data_dir:
        extra = ["--secure", "--data-dir", data_dir, "--allow-key", CONSUMER.public_key.hex()]
        with executor_process(extra=extra) as (address, proc):
            host, port = address.split(":")
            yield host, int(port), proc.provider_key


def test_training_through_a_forced_disconnect_matches_local_cpu(secure_executor):
    host, port, provider_key = secure_executor
    channel = connect_secure(host, port, identity=CONSUMER, expected_peer_public_key=provider_key)
    real_send = channel._link.sendmsg_all
    sends = 0

    def send_then_cut(chunks):
        nonlocal sends
        sends += 1
        if sends == 10:  # mid-run: the TCP connection under the session dies
            channel._link.sock.shutdown(socket.SHUT_RDWR)
        real_send(chunks)

    channel._link.sendmsg_all = send_then_cut
    with remote.attach(channel=channel):
        remote_losses, remote_params = train("mlp", "cumulus", steps=12)
    assert channel.resumes >= 1
    local_losses, local_params = train("mlp", "cpu", steps=12)
    assert remote_losses == local_losses
    for name, value in local_params.items():
        assert torch.equal(remote_params[name], value), name


def test_consumer_off_the_allow_list_is_refused(secure_executor):
    host, port, provider_key = secure_executor
    stranger = NodeIdentity.generate()
    with pytest.raises(SessionRefusedError, match="allow list"):
        connect_secure(host, port, identity=stranger, expected_peer_public_key=provider_key)


def test_bad_allow_key_flag_is_a_clear_cli_error(capsys):
    from cumulus_p2p.host.executor_main import main

    with pytest.raises(SystemExit):
        main(["--secure", "--allow-key", "not-hex"])
    assert "64-hex-digit" in capsys.readouterr().err
