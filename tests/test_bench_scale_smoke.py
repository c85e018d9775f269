"""benchmarks/bench_scale.py measures on real ranks: 2 and 4 single-rank nodes, 8 tensors each.

Checks that the harness measures and reports (structure, and invariants that hold whatever the
coordination costs: bytes are counted, the loaded state is bit-exact, both restarts choose the newest
version, the wiped node gets its objects back), never how large the numbers are: the
scale targets belong to the code being measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)
REPO = Path(__file__).resolve().parents[1]
RANKS = (2, 4)
SAVES = 2
TABLES = ("SAVE (", "RECOVERY (", "LOAD after", "EXTRAPOLATION to N = 4096 ranks on 512 nodes")


def run_harness(root: Path, report: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "benchmarks/bench_scale.py", "--ranks", ",".join(map(str, RANKS)),
               "--ranks-per-node", "1", "--tensors", "8", "--saves", str(SAVES), "--timeout", "150",
               "--root", str(root), "--json", str(report)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=170)


def leftover_ranks(report: Path) -> list[psutil.Process]:
    """Rank processes still alive: forked from the harness, they carry its command line (with the report's path)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if str(report) in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def test_bench_scale_measures_saves_recoveries_and_a_bit_exact_load(shm_dir: Path, tmp_path: Path):
    report = tmp_path / "scale.json"
    result = run_harness(shm_dir, report)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    out = result.stdout
    assert out.startswith("bench_scale:") and "\ncommand: " in out and "\ncpu: " in out, out[:2000]
    for title in TABLES:
        assert title in out, f"{title!r} missing:\n{out}"
    assert "alpha = " in out and "beta = " in out, out  # the latency model states its constants

    data = json.loads(report.read_text())
    assert data["failures"] == [] and "bench_scale.py" in data["command"]
    rows = {row["ranks"]: row for row in data["rows"]}
    raw = {point["ranks"]: point for point in data["raw"]}
    assert sorted(rows) == list(RANKS)
    for n, row in rows.items():
        assert row["nodes"] == n and row["tensors"] == 8, row
        for which in ("save_first", "save_steady"):
            save = row[which]
            assert save["collectives"]["max"] > 0 and save["received"]["max"] > 0, (n, which, save)
            assert save["received"]["mean"] <= save["received"]["max"], save
            assert save["blocking_s"]["max"] > 0 and save["commit_s"]["max"] > 0, save
            assert save["replication_states"] == ["replicated"], save  # k=2 on >= 2 nodes
        assert row["tmpfs_per_node"]["max"] > 0
        intact, lost = row["recovery_intact"], row["recovery_lost"]
        assert intact["chosen"] == [str(SAVES)] and lost["chosen"] == [str(SAVES)], (intact, lost)
        assert intact["node_lost"] is None and intact["collectives"]["max"] > 0, intact
        assert len(raw[n]["intact_fetched_per_node"]) == n and intact["fetched_total"] >= 0, intact
        assert lost["node_lost"] == 0, lost
        fetched = raw[n]["lost_fetched_objects_per_node"]
        assert fetched[0] > 0, fetched  # the wiped node got its objects back (the load above proves they are right)
        assert row["load"]["bit_exact"] is True and row["load"]["collectives"]["max"] > 0, row["load"]
        assert row["calibration"]["alpha_s"] > 0, row["calibration"]
    # Every rank of every world reported, and the counts come from the ranks' own windows.
    for point in data["raw"]:
        for phase in ("save", "intact", "lost"):
            assert sorted(r["rank"] for r in point[phase]) == list(range(point["ranks"])), (phase, point["ranks"])
    fitted = {f["metric"]: f for f in data["fits"]}
    assert fitted["save bytes recv/rank max"]["at_target"] is not None, fitted
    assert {m["window"] for m in data["modelled"]["assumed"]} >= {"save (steady)", "recovery (lost)"}
    assert not any(shm_dir.iterdir()), "the harness left its temporary directory behind"
    assert not leftover_ranks(report), "rank processes outlived the harness"


def test_what_a_rank_receives_per_save_does_not_grow_with_the_ranks(shm_dir: Path, tmp_path: Path):
    """4 and 8 ranks on 2 and 4 nodes (k=2, more nodes than replicas), counted per rank by the harness: per steady
    save a rank that is neither the coordinator nor a node leader receives the same few fixed-size all-reduces at
    both sizes; a leader also receives the commit record (~70-100 B more per saved object) and its node's records;
    rank 0 gets every rank's object record, not its write records: O(N) bytes, not O(N*T) (64 tensors: ~5 KB more
    per rank before), through the node leaders: no gather over every rank."""
    report = tmp_path / "flat.json"
    command = [sys.executable, "benchmarks/bench_scale.py", "--ranks", "4,8", "--ranks-per-node", "2", "--tensors",
               "64", "--saves", "2", "--timeout", "150", "--root", str(shm_dir), "--json", str(report)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    data = json.loads(report.read_text())
    for row in data["rows"]:  # the records reach rank 0 in two levels: node groups, then the node leaders
        scopes = row["save_steady"]["collectives_by_scope"]
        assert scopes.get("linear:node") == 1 and scopes.get("linear:across") == 1, scopes
        assert "linear:world" not in scopes, scopes
    received: dict[int, list[int]] = {}
    for point in data["raw"]:
        steady = [r["saves"][1] for r in sorted(point["save"], key=lambda r: r["rank"])]
        received[point["ranks"]] = [s["blocking"]["received"] + s["commit"]["received"] for s in steady]
    plain = {n: {b for r, b in enumerate(per_rank) if r % 2 == 1} for n, per_rank in received.items()}
    leaders = {n: {b for r, b in enumerate(per_rank) if r % 2 == 0 and r > 0} for n, per_rank in received.items()}
    assert plain[4] == plain[8] and len(plain[8]) == 1 and max(plain[8]) <= 256, received
    assert len(leaders[8]) == 1 and 0 < max(leaders[8]) - max(leaders[4]) <= 4 * 150, received
    assert 0 < received[8][0] - received[4][0] <= 4 * 200, received  # the coordinator: ~150 B per rank
