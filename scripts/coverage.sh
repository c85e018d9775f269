#!/usr/bin/env bash
# Python line and branch coverage of the tests, child processes included (pyproject's [tool.coverage]:
# patch = subprocess starts coverage in every Python process the tests start, patch = fork in every rank
# forked by the test fork servers). .ci/run runs it with the gate, in place of the plain pytest run.
#
# Usage: bash scripts/coverage.sh [pytest arguments]   (default: the whole suite)
# Prints the line and branch figures and each module's; with FLASHPOINT_COVERAGE_GATE=1 it fails
# below 92% of lines or 85% of branches (meaningful for the whole suite only).
# A process killed by SIGKILL (the crash tests do that on purpose) leaves no data: what it ran is
# counted as not covered. Tests marked `unmeasured` (the benchmark smokes, the examples, the wheel, the
# quickstart and a few other NeMo end-to-end runs) run their processes untraced: tracing doubles a NeMo
# process's CPU time, and what they run other tests measure (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
rm -rf build/coverage && mkdir -p build/coverage
started=$SECONDS
status=0
$py -m coverage run -m pytest -q -p no:cacheprovider "${@:-tests}" || status=$?
echo "coverage: tests took $((SECONDS - started)) s (pytest exit status $status)"
$py -m coverage combine -q
$py -m coverage report --sort=cover --format=text | tail -n 40
$py -m coverage json -q -o build/coverage/coverage.json
$py - "${FLASHPOINT_COVERAGE_GATE:-0}" <<'PY'
import json, sys
totals = json.load(open("build/coverage/coverage.json"))["totals"]
lines = 100.0 * totals["covered_lines"] / max(totals["num_statements"], 1)
branches = 100.0 * totals["covered_branches"] / max(totals["num_branches"], 1)
print(f"Python coverage: lines {lines:.1f}% ({totals['covered_lines']}/{totals['num_statements']}), "
      f"branches {branches:.1f}% ({totals['covered_branches']}/{totals['num_branches']}); targets 92% / 85%")
if sys.argv[1] == "1" and (lines < 92 or branches < 85):
    sys.exit("Python coverage below its gate")
PY
exit $status
