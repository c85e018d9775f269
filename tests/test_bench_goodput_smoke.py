"""benchmarks/bench_goodput.py runs end to end on a tiny GPT (2 ranks, a real SIGKILL and restart).

Only configuration c (RAM every N + NeMo durable every K) runs, to stay within ~2 minutes on
2 cores; the shape of the report and the consistency of its numbers are checked, never the
values themselves (they depend on the machine).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)
REPO = Path(__file__).resolve().parents[1]
RECOVERY_PARTS = ("start_imports_s", "setup_s", "restore_s", "first_step_s")


def test_bench_goodput_tiny_reports_consistent_numbers(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_goodput.py", "--json", "--configs", "c", "--size", "0.001",
         "--steps", "7", "--restart-steps", "1", "--ram-every", "2", "--durable-every", "4",
         "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    by_name = {row["name"]: row for row in rows if row["name"] != "config"}
    assert {"setup", "targets"} <= by_name.keys()
    (c,) = [row for row in rows if row["name"] == "config"]
    assert c["config"] == "c" and c["available"] is True
    assert c["median_step_s"] > 0 and c["mean_step_s"] > 0
    assert c["overhead_pct"] is None  # no reference configuration a in this run

    ram, durable = c["saves"]["ram"], c["saves"]["durable"]
    assert ram["saves"] == 2 and durable["saves"] >= 1  # RAM at steps 2 and 6 (4 is skipped: durable saves there)
    assert ram["steady_saves"] == 1 and ram["blocking_s"] == ram["blocking_all_s"][1]  # the first is reported apart
    assert ram["blocking_cpu_s"] > 0 and c["median_step_cpu_s"] > 0
    assert math.isclose(ram["fixed_cost_s"] + ram["staging_copy_s"], ram["blocking_s"], rel_tol=1e-9)
    # the job's stall per save needs every rank's record of it (rank 1's train file is read too)
    assert ram["job_blocking_s"] > 0
    assert math.isclose(ram["job_fixed_cost_s"] + ram["staging_copy_s"], ram["job_blocking_s"], rel_tol=1e-9)
    assert ram["staging_copy_s"] > 0 and ram["job_checkpoint_bytes"] > 0
    # the instrumented calls happen inside the blocking time of the saves
    per_save = ram["spans_per_save_s"]
    assert 0 < per_save["dist_checkpointing.save"] <= per_save["checkpoint_io.save_checkpoint"]

    recovery = c["recovery"]
    assert all(recovery[part] >= 0 for part in RECOVERY_PARTS), recovery
    assert recovery["restore_cpu_s"] > 0
    # the first step's CPU: the training thread's and the others', and each live thread's by name (from /proc)
    assert recovery["first_step_cpu_main_s"] > 0 and recovery["first_step_cpu_other_threads_s"] >= 0
    assert recovery["thread_cpu_at_first_step_s"]["MainThread"] >= recovery["first_step_cpu_main_s"] - 0.02
    assert math.isclose(sum(recovery[part] for part in RECOVERY_PARTS), recovery["total_s"], rel_tol=1e-9)
    # killed after step 7: the newest checkpoint is RAM step 6 (durable: step 4)
    assert recovery["killed_at"] == 7
    assert recovery["resumed_from"] == "ram" and recovery["resumed_step"] == 6 and recovery["steps_lost"] == 1
    assert c["ettr"] is None  # needs the reference step time of a

    targets = by_name["targets"]
    assert targets["meets_target"]["ram_fixed_cost_s"] in (True, False)
    assert targets["meets_target"]["ram_fixed_cost_job_s"] in (True, False)
    assert targets["values"]["ram_fixed_cost_job_s"] == ram["job_fixed_cost_s"]
    assert targets["meets_target"]["restore_speedup_ram_vs_durable"] is None  # needs b and c in one run
    assert not (tmp_path / "out" / "c" / "logs").exists(), "durable checkpoints were left behind"


def test_the_jobs_stall_runs_from_the_last_rank_in_to_the_last_rank_out():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_goodput import job_stall_s

    def save(step: int, start: float, end: float, kind: str = "ram") -> dict:
        return {"kind": kind, "step": step, "started_at": start, "ended_at": end}

    # rank 0 enters at 10.0 and waits for rank 1 (in at 10.4); both leave by 10.6: the job lost 0.2 s
    assert math.isclose(job_stall_s(save(5, 10.0, 10.5), [[save(5, 10.4, 10.6)]]), 0.2)
    # the other way round: rank 0 is the last in and the last out
    assert math.isclose(job_stall_s(save(5, 10.4, 10.7), [[save(5, 10.0, 10.6)]]), 0.3)
    # the peer's record of the same save is found by kind and step among others
    peers = [[save(5, 9.0, 9.1, kind="durable"), save(4, 9.0, 9.1), save(5, 10.1, 10.2)]]
    assert math.isclose(job_stall_s(save(5, 10.0, 10.3), peers), 0.2)
    # a rank without that save, or a record without wall-clock stamps: not measured
    assert job_stall_s(save(5, 10.0, 10.3), [[save(4, 10.0, 10.3)]]) is None
    assert job_stall_s(save(5, 10.0, 10.3), [[{"kind": "ram", "step": 5}]]) is None
