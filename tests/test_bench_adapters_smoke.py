"""benchmarks/bench_adapters.py runs end to end on a tiny state and reports every measurement.

Only the shape of the report is checked, never the numbers: they depend on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)
REPO = Path(__file__).resolve().parents[1]
BUDGETED = {"target", "meets_target"}
DCP_SPLIT = {"dcp_seconds", "core_seconds", "dcp_gbps", "core_gbps", "overhead", "runs", "flashpoint_seconds",
             "flashpoint_overhead", "flashpoint_meets_target", "torch_part_seconds", "torch_seconds"} | BUDGETED
REQUIRED = {
    "staging_copy": {"seconds", "gbps", "threads", "seconds_1thread", "gbps_1thread", "runs", "nbytes"},
    "async_blocking": {"seconds", "save_seconds", "schedule_seconds", "stage_copy_seconds", "staging_copy_seconds",
                       "staging_copy_1thread_seconds", "ratio_blocking_over_staging", "megatron_cpu_shim",
                       "worker_start_seconds", "runs", "nbytes"} | BUDGETED,
    "dcp_save_vs_core": DCP_SPLIT | {"plan_cached_seconds"},
    "dcp_load_vs_core": DCP_SPLIT,
    "manager_warmup_return": {"seconds", "ready_seconds", "runs"} | BUDGETED,
    "manager_ready_nemo": {"return_seconds", "ready_seconds", "nemo_import_seconds"} | BUDGETED,
    "manager_ready_bare": {"return_seconds", "ready_seconds"} | BUDGETED,
}


def test_bench_adapters_quick_reports_every_measurement(base_dir: Path):
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_adapters.py", "--quick", "--json", "--base-dir", str(base_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert REQUIRED.keys() <= rows.keys(), f"missing {REQUIRED.keys() - rows.keys()}"
    for name, fields in REQUIRED.items():
        assert fields <= rows[name].keys(), f"{name} lacks {fields - rows[name].keys()}"
        if "meets_target" in fields:
            assert isinstance(rows[name]["meets_target"], bool), name
    for name in ("dcp_save_vs_core", "dcp_load_vs_core"):  # the split adds up: ours + DCP's own part = the call
        split = rows[name]
        assert 0 < split["flashpoint_seconds"] < split["dcp_seconds"], split
        assert 0 < split["torch_part_seconds"] < split["dcp_seconds"], split
    assert not any(base_dir.iterdir()), "the benchmark left files behind"
