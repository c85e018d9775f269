"""The benchmarks (bench_core.py, bench_crc32c.py, bench_transfer_authz.py, bench_first_save.py,
bench_save_phases.py) run end to end on tiny inputs and report every measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)
REPO = Path(__file__).resolve().parents[1]
REQUIRED = {
    "memcpy", "copy_limit", "save_warm", "save_nocrc", "save_first", "load", "load_file",
    "dcp_save", "dcp_load", "torch_save", "torch_load",
}


def test_bench_core_quick_reports_every_measurement(base_dir: Path):
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_core.py", "--quick", "--json", "--base-dir", str(base_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert REQUIRED <= rows.keys(), f"missing {REQUIRED - rows.keys()}"
    for name, row in rows.items():
        assert row["gbps"] > 0, name
        assert row["ratio_vs_memcpy"] > 0, name
        assert row["seconds"] > 0 and row["runs"] == 1 and row["nbytes"] > 0, name
    assert rows["memcpy"]["ratio_vs_memcpy"] == 1.0
    assert rows["memcpy"]["single_threaded"] is True
    assert rows["copy_limit"]["ratio_vs_limit"] == 1.0 and rows["copy_limit"]["stores"] in ("plain memcpy",
                                                                                            "non-temporal")
    assert all("ratio_vs_limit" in row for row in rows.values())
    assert "checksum_overhead" in rows["save_warm"]
    assert "warmup_seconds" in rows["save_first"]
    assert not any(base_dir.iterdir()), "the benchmark left files behind"


def test_bench_crc32c_reports_every_backend_against_memcpy():
    from ml_flashpoint_nemo import _core

    result = subprocess.run(
        [sys.executable, "benchmarks/bench_crc32c.py", "--kib", "64", "--calls", "5", "--rounds", "3", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert rows.keys() == ({"memcpy"} | {f"crc32c {b}" for b in _core.crc32c_backends()}
                           | {"gmac"})
    assert rows["memcpy"]["cost_vs_memcpy"] == 1.0
    for name, row in rows.items():
        assert row["cpu_gbps"] > 0 and row["cost_vs_memcpy"] > 0 and row["nbytes"] == 64 << 10, name


def test_bench_transfer_authz_reports_both_servers_and_ratios():
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_transfer_authz.py", "--small", "3", "--mib", "1", "--large", "1",
         "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    for kind in ("open", "policy"):
        for key in ("small_wall", "small_cpu", "large_wall", "large_cpu"):
            assert report[f"median_{kind}_{key}_s"] > 0, (kind, key)
    assert all(report[f"ratio_{key}_policy_vs_open"] > 0 for key in ("small_wall", "small_cpu", "large_wall",
                                                                      "large_cpu"))


def test_bench_first_save_compares_the_first_save_with_later_ones_and_times_the_planning(shm_dir: Path):
    command = [sys.executable, "benchmarks/bench_first_save.py", "--size-gib", "0.01", "--runs", "2", "--saves", "3",
               "--repeats", "2", "--base-dir", str(shm_dir)]
    result = subprocess.run([*command, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert len(report["runs"]) == 2 and report["records"] > 0
    assert all(run["first_ms"] > 0 and run["later_median_ms"] > 0 for run in report["runs"])
    assert all(report[key] > 0 for key in ("tensor_columns_ms", "plan_object_ms", "index_template_ms",
                                           "padding_ops_ms"))
    assert report["index_template_ms"] < report["plan_object_ms"] * 1.5  # a part of it (timed separately)
    assert not any(shm_dir.iterdir()), "the benchmark left files behind"
    refused = subprocess.run([*command[:7], "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--saves must be at least 2" in refused.stderr


def test_bench_save_phases_times_steady_saves_the_long_way_and_by_the_recipe():
    command = [sys.executable, "benchmarks/bench_save_phases.py", "--parts", "tensors", "--tensors", "40", "--saves",
               "4", "--repeats", "1", "--json"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])["tensors"]
    assert report["saves_per_config"] == {"long": 4, "recipe": 4}  # saves 3 and 4 of each rank
    long, recipe = report["median_ms"]["long"], report["median_ms"]["recipe"]
    assert long["megatron: mcore_to_pyt_state_dict"] > 0 and "recipe: replay+staging" not in long
    assert recipe["recipe: replay+staging"] > 0 and "megatron: mcore_to_pyt_state_dict" not in recipe
    assert report["recipe_over_long"] > 0
