"""Specs for cumulus_p2p.identity: the node key and its derived peer ID."""

import stat

import pytest

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
