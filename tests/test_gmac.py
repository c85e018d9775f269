"""AES-256-GMAC, the tag of protocol v3 (csrc/crypto.cpp: libcrypto's AES-256-GCM with the message
as additional data, docs/protocol.md): it matches the published test vectors and the test peer's
tags (the `cryptography` package) on random messages fed in random pieces, and it comes from
OpenSSL's libcrypto, the only implementation in the extension.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ml_flashpoint_nemo import _core

# (source, key, nonce, additional data, tag): AES-256-GCM with an empty plaintext.
VECTORS = [
    ("NIST CAVP gcmEncryptExtIV256 PTlen=0 AADlen=0 Count=0",
     "b52c505a37d78eda5dd34f20c22540ea1b58963cf8e5bf8ffa85f9f2492505b4", "516c33929df5a3284ff463d7", "",
     "bdc1ac884d332457a1d2664f168c76f0"),
    ("NIST CAVP gcmEncryptExtIV256 PTlen=0 AADlen=128 Count=0",
     "78dc4e0aaf52d935c3c01eea57428f00ca1fd475f5da86a49c8dd73d68c8e223", "d79cf22d504cc793c3fb6c8a",
     "b96baa8c1c75a671bfb2d08d06be5f36", "3e5d486aa2e30b22e040b85723a06e76"),
    ("NIST CAVP gcmEncryptExtIV256 PTlen=0 AADlen=128 Count=1",
     "4457ff33683cca6ca493878bdc00373893a9763412eef8cddb54f91318e0da88", "699d1f29d7b8c55300bb1fd2",
     "6749daeea367d0e9809e2dc2f309e6e3", "d60c74d2517fde4a74e0cd4709ed43a9"),
    ("NIST CAVP gcmEncryptExtIV256 PTlen=0 AADlen=160 Count=0",
     "886cff5f3e6b8d0e1ad0a38fcdb26de97e8acbe79f6bed66959a598fa5047d65", "3a8efa1cd74bbab5448f9945",
     "519fee519d25c7a304d6c6aa1897ee1eb8c59655", "f6d47505ec96c98a42dc3ae719877b87"),
    ("McGrew-Viega GCM test case 13 (all-zero key and IV)",
     "00" * 32, "00" * 12, "", "530f8afbc74536b9a963b4f1c4cb738b"),
    ("IEEE 802.1AE 2.1.2 54-byte packet authentication, GCM-AES-256",
     "e3c08a8f06c6e3ad95a70557b23f75483ce33021a9c72b7025666204c69c0b72", "12153524c0895e81b2c28465",
     "d609b1f056637a0d46df998d88e5222ab2c2846512153524c0895e8108000f101112131415161718191a1b1c1d1e1f20"
     "2122232425262728292a2b2c2d2e2f30313233340001", "2f0bc5af409e06d609ea8b7d0fa5ea50"),
]


@pytest.mark.parametrize("vector", VECTORS, ids=[v[0] for v in VECTORS])
def test_published_vectors(vector):
    _, key, nonce, aad, tag = (bytes.fromhex(x) if i else x for i, x in enumerate(vector))
    assert _core.gmac(key, nonce, [aad]).hex() == tag.hex()
    # Fed one byte at a time (one libcrypto update each): the same tag.
    assert _core.gmac(key, nonce, [aad[i:i + 1] for i in range(len(aad))]) == tag


@pytest.mark.parametrize("vector", VECTORS, ids=[v[0] for v in VECTORS])
def test_the_test_peers_tags_match_the_published_vectors(vector):
    _, key, nonce, aad, tag = (bytes.fromhex(x) if i else x for i, x in enumerate(vector))
    assert AESGCM(key).encrypt(nonce, b"", aad) == tag


def _random_case(rng: random.Random, length: int) -> tuple[bytes, bytes, bytes, list[bytes]]:
    key, nonce, data = rng.randbytes(32), rng.randbytes(12), rng.randbytes(length)
    parts, at = [], 0
    while at < length:  # pieces of 1..~600 bytes, so that blocks straddle them in every way
        n = min(length - at, rng.choice([1, 3, 15, 16, 17, 64, 255, 256, 257, 600]))
        parts.append(data[at:at + n])
        at += n
    return key, nonce, data, parts


def test_pieces_give_the_tag_of_the_whole_message():
    rng = random.Random(20261203)
    lengths = list(range(0, 300)) + [rng.randrange(300, 70_000) for _ in range(40)] + [256 << 10, (1 << 20) + 13]
    for length in lengths:
        key, nonce, data, parts = _random_case(rng, length)
        assert _core.gmac(key, nonce, parts) == _core.gmac(key, nonce, [data]), length


def test_the_test_peers_tags_agree_with_the_extensions():
    rng = random.Random(7)
    for length in [0, 1, 15, 16, 17, 255, 256, 257, 4099]:
        key, nonce, data, parts = _random_case(rng, length)
        assert _core.gmac(key, nonce, parts) == AESGCM(key).encrypt(nonce, b"", data), length


def test_a_changed_byte_nonce_or_key_changes_the_tag():
    rng = random.Random(3)
    key, nonce, data, _ = _random_case(rng, 1000)
    tag = _core.gmac(key, nonce, [data])
    flipped = bytearray(data)
    flipped[999] ^= 1
    assert _core.gmac(key, nonce, [bytes(flipped)]) != tag
    assert _core.gmac(key, bytes(12), [data]) != tag
    assert _core.gmac(bytes(32), nonce, [data]) != tag
    assert _core.gmac(key, nonce, [data + b"\0"]) != tag  # the length is authenticated too


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        _core.gmac(bytes(16), bytes(12), [b"x"])
    with pytest.raises(ValueError, match="nonce must be 12 bytes"):
        _core.gmac(bytes(32), bytes(16), [b"x"])


def test_every_primitive_comes_from_openssl_libcrypto():
    """The extension runs OpenSSL 3's libcrypto and offers no other implementation to choose."""
    assert re.fullmatch(r"OpenSSL [3-9]\.\d+\.\d+\S* .*", _core.crypto_library()), _core.crypto_library()
    mapped = Path("/proc/self/maps").read_text()
    assert re.search(r"/libcrypto\.so\.[3-9]", mapped), "libcrypto is not loaded by the extension"
    for gone in ("gmac_backends", "set_transfer_mac_backend", "transfer_mac_backend", "sha256"):
        assert not hasattr(_core, gone), gone
