"""AES-256-GMAC in pure Python (NIST SP 800-38D: GCM with only additional data), for the test peer.

Written from the specifications (FIPS 197 for AES, SP 800-38D for GHASH; GHASH in GCM's own bit
order with byte-indexed tables of multiples of H), independent of OpenSSL's libcrypto, which
computes the extension's tags. Tests check both against the published test vectors and against
each other. Not constant time: test use only.
"""

from __future__ import annotations


def _gf256_mul(a: int, b: int) -> int:
    product = 0
    for _ in range(8):
        if b & 1:
            product ^= a
        a = ((a << 1) ^ (0x11B if a & 0x80 else 0)) & 0xFF
        b >>= 1
    return product


def _make_sbox() -> bytes:
    inverse = [0] * 256
    for a in range(1, 256):
        for b in range(1, 256):
            if _gf256_mul(a, b) == 1:
                inverse[a] = b
                break
    out = bytearray(256)
    for a in range(256):
        x = inverse[a]
        s = x
        for r in range(1, 5):
            s ^= ((x << r) | (x >> (8 - r))) & 0xFF
        out[a] = s ^ 0x63
    return bytes(out)


SBOX = _make_sbox()


def _xtime(b: int) -> int:
    return ((b << 1) ^ 0x1B) & 0xFF if b & 0x80 else b << 1


def expand_key(key: bytes) -> list[bytes]:
    """The 15 round keys of AES-256."""
    if len(key) != 32:
        raise ValueError("AES-256 needs a 32-byte key")
    words = [list(key[4 * i:4 * i + 4]) for i in range(8)]
    rcon = 1
    for i in range(8, 60):
        t = list(words[i - 1])
        if i % 8 == 0:
            t = [SBOX[t[1]] ^ rcon, SBOX[t[2]], SBOX[t[3]], SBOX[t[0]]]
            rcon = _xtime(rcon)
        elif i % 8 == 4:
            t = [SBOX[b] for b in t]
        words.append([a ^ b for a, b in zip(words[i - 8], t)])
    return [bytes(sum(words[4 * r:4 * r + 4], [])) for r in range(15)]


def encrypt_block(round_keys: list[bytes], block: bytes) -> bytes:
    """AES-256 of one 16-byte block (state byte r + 4c is row r, column c)."""
    s = [a ^ b for a, b in zip(block, round_keys[0])]
    for rnd in range(1, 15):
        s = [SBOX[s[r + 4 * ((c + r) % 4)]] for c in range(4) for r in range(4)]
        if rnd < 14:
            mixed = []
            for c in range(4):
                a = s[4 * c:4 * c + 4]
                total = a[0] ^ a[1] ^ a[2] ^ a[3]
                mixed += [a[r] ^ total ^ _xtime(a[r] ^ a[(r + 1) % 4]) for r in range(4)]
            s = mixed
        s = [a ^ b for a, b in zip(s, round_keys[rnd])]
    return bytes(s)


_R = 0xE1 << 120  # x^128 = x^7 + x^2 + x + 1, in GCM's bit order (bit 127 of the integer is x^0)


class Gmac:
    """AES-256-GMAC under one key: tag(nonce, data) -> 16 bytes."""

    def __init__(self, key: bytes):
        self._round_keys = expand_key(key)
        h = int.from_bytes(encrypt_block(self._round_keys, bytes(16)), "big")
        powers = []  # H * x^k for k = 0..127
        for _ in range(128):
            powers.append(h)
            h = (h >> 1) ^ _R if h & 1 else h >> 1
        # tables[i][b] = (byte b at position i of a block) * H; the byte's top bit is x^(8i).
        self._tables = []
        for i in range(16):
            table = [0] * 256
            for b in range(1, 256):
                low = b & -b
                table[b] = table[b ^ low] ^ powers[8 * i + 7 - (low.bit_length() - 1)]
            self._tables.append(table)

    def _ghash(self, data: bytes, y: int = 0) -> int:
        t = self._tables
        t0, t1, t2, t3, t4, t5, t6, t7 = t[:8]
        t8, t9, t10, t11, t12, t13, t14, t15 = t[8:]
        whole = len(data) // 16 * 16
        blocks = [int.from_bytes(data[off:off + 16], "big") for off in range(0, whole, 16)]
        if whole < len(data):
            blocks.append(int.from_bytes(data[whole:].ljust(16, b"\0"), "big"))
        for x in blocks:
            b = (y ^ x).to_bytes(16, "big")
            y = (t0[b[0]] ^ t1[b[1]] ^ t2[b[2]] ^ t3[b[3]] ^ t4[b[4]] ^ t5[b[5]] ^ t6[b[6]] ^ t7[b[7]]
                 ^ t8[b[8]] ^ t9[b[9]] ^ t10[b[10]] ^ t11[b[11]] ^ t12[b[12]] ^ t13[b[13]] ^ t14[b[14]]
                 ^ t15[b[15]])
        return y

    def ghash_of(self, data: bytes) -> int:
        """GHASH of the message and its length block: the part of a tag that does not depend on the nonce."""
        return self._ghash((8 * len(data)).to_bytes(8, "big") + bytes(8), self._ghash(data))

    def tag(self, nonce: bytes, data: bytes, ghash: int | None = None) -> bytes:
        """The tag of data under nonce (12 bytes); ghash, if given, is ghash_of(data) computed before."""
        if len(nonce) != 12:
            raise ValueError("GMAC nonce must be 12 bytes")
        s = self.ghash_of(data) if ghash is None else ghash
        mask = int.from_bytes(encrypt_block(self._round_keys, nonce + b"\0\0\0\x01"), "big")
        return (s ^ mask).to_bytes(16, "big")
