"""The benchmarks' own references (benchmarks/references.py): every ratio the benchmarks print divides
by them, so they must move exactly the bytes they claim to."""

from __future__ import annotations

import ctypes
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from references import memmove_shares, raw_tcp_throughput, split_into_shares  # noqa: E402

MiB = 1 << 20


def address_of(data: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))


def odd_copies(rng: random.Random, source_size: int, sizes: list[int]) -> tuple[list[tuple[int, int, int]], int]:
    """(source offset, destination offset, nbytes) rows with a gap before each; returns them and the end."""
    rows, dst = [], 0
    for nbytes in sizes:
        dst += rng.randrange(1, 100)
        rows.append((rng.randrange(0, source_size - nbytes), dst, nbytes))
        dst += nbytes
    return rows, dst


@pytest.mark.parametrize("threads", [1, 3, 50])
def test_memmove_references_copy_every_byte_and_nothing_else(threads):
    rng = random.Random(15)
    source = bytearray(rng.randbytes(12 * MiB))
    rows, end = odd_copies(rng, len(source), [9 * MiB + 7, 1, 0, 4 * MiB - 3, 70_001, 5])
    dest = bytearray(b"\x5a" * (end + 64))
    src_base, dst_base = address_of(source), address_of(dest)
    copies = [(src_base + s, dst_base + d, n) for s, d, n in rows]
    memmove_shares(split_into_shares(copies, threads))
    expected = bytearray(b"\x5a" * len(dest))
    for s, d, n in rows:
        expected[d : d + n] = source[s : s + n]
    assert dest == expected


@pytest.mark.parametrize("shares", [1, 2, 3, 7, 100])
def test_shares_are_contiguous_even_and_cover_every_byte_once(shares):
    copies = [(1000, 50_000, 10_001), (0, 0, 0), (70_000, 90_000, 3), (200_000, 300_000, 4097)]
    split = split_into_shares(copies, shares, piece_bytes=1024)
    total = sum(n for _, _, n in copies)
    assert len(split) <= shares
    flat = [piece for share in split for piece in share]
    assert all(0 < n <= 1024 for _, _, n in flat)
    sizes = [sum(n for _, _, n in share) for share in split]
    assert sum(sizes) == total
    assert all(size == -(-total // shares) for size in sizes[:-1])
    covered = [(s + i, d + i) for s, d, n in flat for i in range(n)]
    assert covered == [(s + i, d + i) for s, d, n in copies for i in range(n)]


@pytest.mark.parametrize("nbytes, chunk", [(3 * MiB + 5, 256 << 10), (100_003, 4097), (1, 1)])
def test_raw_tcp_reference_moves_the_exact_byte_count(nbytes, chunk):
    """The receiver raises if fewer or more than nbytes arrive; the call returns only when exactly nbytes did."""
    result = raw_tcp_throughput(nbytes, chunk)
    assert result["nbytes"] == nbytes
    assert result["seconds"] > 0 and result["bytes_per_s"] == pytest.approx(nbytes / result["seconds"])


@pytest.mark.parametrize("chunk", [0, (64 << 20) + 1])
def test_raw_tcp_reference_refuses_chunks_out_of_range(chunk):
    with pytest.raises(ValueError, match="chunk_bytes"):
        raw_tcp_throughput(1024, chunk)
