"""benchmarks/bench_nvrx.py runs end to end on 2 ranks with a small state: every configuration is measured, nothing is left.

Checks the shape and consistency of the report, never the values (they depend on the machine and belong to
the code being measured; docs/performance.md has a full run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)
REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("flashpoint", "flashpoint_persistent", "nemo_path", "nvrx", "nvrx_clique")


def test_bench_nvrx_measures_every_configuration_in_interleaved_rounds(shm_dir: Path):
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_nvrx.py",
            "--mib",
            "2",
            "--rounds",
            "2",
            "--root",
            str(shm_dir),
            "--json",
            "--timeout",
            "240",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert "bench_nvrx.py" in report["command"] and report["cpu"] and report["rounds"] == 2
    for kind in CONFIGS:
        convert, blocks, to_commit = (report["seconds"][kind][phase] for phase in ("convert", "blocks", "to_commit"))
        assert len(convert) == len(blocks) == len(to_commit) == 2, (kind, report)
        assert all(0 <= v < b <= c for v, b, c in zip(convert, blocks, to_commit)), (kind, report)  # parts in order
    assert report["seconds"]["nemo_path"]["convert"] == [0.0, 0.0]  # dist_checkpointing.save takes the state as it is
    assert set(report["ratios"]) == {
        f"{ours}_over_{reference}"
        for ours in ("flashpoint", "flashpoint_persistent")
        for reference in ("nemo_path", "nvrx", "nvrx_clique")
    }
    assert all(len(values) == 2 and min(values) > 0 for values in report["ratios"].values()), report["ratios"]
    assert not any(shm_dir.iterdir()), "the benchmark left its directories behind"
