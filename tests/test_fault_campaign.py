"""The fault campaign (benchmarks/fault_campaign.py) on every fault kind once: no wrong load, no hang.

Each run is real 2-rank training (gloo) with flashpoint saves and replication, one injected fault
(SIGKILL at a point of stage / write / commit / node copy / replicate, of the receiving peer or at
a random time; a flipped bit in an object, a commit record or a version file; a wiped node; a full
tmpfs; a Manager that cannot start) and a recovery run checked against the SHA-256 of the state
saved at the resumed step and against an uninterrupted reference. docs/reliability.md shows a 100-run
campaign; here each kind runs once to keep CI short.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from fault_campaign import KINDS  # noqa: E402

CI_KINDS = ("kill_write", "kill_commit", "kill_replicate", "kill_peer", "flip_commit", "flip_object", "manager_fail")


def test_every_fault_kind_recovers_without_wrong_load_or_hang():
    result = subprocess.run(
        [sys.executable, "benchmarks/fault_campaign.py", "--runs", str(len(CI_KINDS)), "--seed", "7", "--json",
         "--timeout", "150", "--kinds", ",".join(CI_KINDS)],
        cwd=REPO, capture_output=True, text=True, timeout=60 + 2 * 150 * (len(CI_KINDS) + 1),
    )
    assert result.stdout, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    problems = json.dumps(summary["problems"], indent=1)[-16000:]
    assert summary["wrong_loads"] == 0, problems
    assert summary["hangs"] == 0, problems
    assert summary["errors"] == 0, problems
    assert summary["fell_back_unexplained"] == 0, problems
    assert result.returncode == 0, result.stderr[-4000:]
    assert set(CI_KINDS) <= set(KINDS)
    assert set(summary["by_kind"]) == set(CI_KINDS), summary["by_kind"]
    ran = summary["runs"] - summary["skipped"]
    assert summary["recovered_newest"] + summary["fell_back"] == ran, summary
    # faults that leave the newest committed version intact must recover it, not an older one
    for kind in ("kill_write", "kill_commit", "kill_replicate", "flip_commit"):
        assert summary["by_kind"][kind] == {"recovered_newest": 1}, (kind, summary["by_kind"][kind])
    assert summary["by_kind"]["manager_fail"] == {"fell_back": 1}, summary["by_kind"]  # no RAM version exists
