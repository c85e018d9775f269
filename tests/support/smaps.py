"""What the kernel says about one of this process's mappings, from /proc/self/smaps."""

from __future__ import annotations


def mapping_kib(address: int, field: str) -> int:
    """The value in KiB of `field` (e.g. "Rss", "ShmemPmdMapped") of the mapping that starts at address."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            first = line.split(" ", 1)[0]
            if "-" in first and ":" not in first:  # a mapping's first line: "start-end perms ..."
                inside = int(first.split("-", 1)[0], 16) == address
            elif inside and line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {address:#x}")
