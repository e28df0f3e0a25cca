"""Specs for cumulus_p2p.identity: the node key and its derived peer ID."""

import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.peer.id import ID

from cumulus_p2p._errors import IdentityFileError
from cumulus_p2p.identity import (
    KEY_FILE_NAME,
    NodeIdentity,
    peer_id_from_public_key,
    verify,
)


def test_sign_then_verify_round_trips():
    identity = NodeIdentity.generate()
    signature = identity.sign(b"hello")
    assert len(signature) == 64
    assert verify(identity.public_key, b"hello", signature)


def test_verify_refuses_other_data_other_key_and_garbage():
    alice, bob = NodeIdentity.generate(), NodeIdentity.generate()
    signature = alice.sign(b"hello")
    assert not verify(alice.public_key, b"hellO", signature)
    assert not verify(bob.public_key, b"hello", signature)
    assert not verify(alice.public_key[:31], b"hello", signature)
    assert not verify(alice.public_key, b"hello", signature[:63])
    assert not verify(b"\x00" * 32, b"hello", b"\x00" * 64)


def test_peer_id_and_key_pair_derive_from_the_signing_key():
    identity = NodeIdentity.generate()
    assert identity.key_pair.public_key.to_bytes() == identity.public_key
    assert len(identity.public_key) == 32
    assert peer_id_from_public_key(identity.public_key) == identity.peer_id
    assert identity.key_pair.private_key.sign(b"x") == identity.sign(b"x")


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=32, max_size=32))
def test_peer_ids_are_the_ones_libp2p_derives_from_the_same_key(seed):
    identity = NodeIdentity.from_seed(seed)
    libp2p_key = Ed25519PrivateKey.new(seed).get_public_key()
    assert identity.peer_id == ID.from_pubkey(libp2p_key)
    assert identity.peer_id_text == ID.from_pubkey(libp2p_key).to_base58()


def test_the_executor_the_shim_and_the_op_stream_load_no_libp2p():
    probe = (
        "import sys, cumulus_p2p.remote, cumulus_p2p.host.executor_main, cumulus_p2p.shim,"
        " cumulus_p2p.node.attach; from cumulus_p2p.identity import NodeIdentity;"
        " NodeIdentity.generate().peer_id_text;"
        " print(sorted(m for m in sys.modules if 'libp2p' in m or 'multiaddr' in m))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


def test_peer_id_from_public_key_refuses_invalid_key():
    with pytest.raises(ValueError):
        peer_id_from_public_key(b"\x01" * 31)


def test_load_or_create_creates_a_private_file_then_reloads_the_same_key(tmp_path):
    first = NodeIdentity.load_or_create(tmp_path / "node")
    path = tmp_path / "node" / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = NodeIdentity.load_or_create(tmp_path / "node")
    assert second.public_key == first.public_key
    assert second.peer_id == first.peer_id
    assert [p.name for p in path.parent.iterdir()] == [KEY_FILE_NAME]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage",
        b"cumulus-ed25519-seed-v1\nzz\n",
        b"cumulus-ed25519-seed-v1\nabcd\n",
        b"\xff",
    ],
)
def test_load_or_create_refuses_a_corrupt_key_file_and_leaves_it(tmp_path, content):
    path = tmp_path / KEY_FILE_NAME
    path.write_bytes(content)
    with pytest.raises(IdentityFileError, match="move it away"):
        NodeIdentity.load_or_create(tmp_path)
    assert path.read_bytes() == content


def test_repr_shows_peer_id_not_key_material():
    identity = NodeIdentity.generate()
    assert identity.peer_id.to_base58() in repr(identity)
    assert identity.public_key.hex() not in repr(identity)
