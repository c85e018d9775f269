#!/usr/bin/env bash
# Static checks, versions pinned in requirements/constraints.txt, settings in pyproject.toml:
# ruff (must be clean), mypy's stubtest of the C++ extension's stub (must match), and mypy on the
# package, which must not report more errors than MYPY_BASELINE (it is not clean yet: the number
# only goes down). Prints each result.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
MYPY_BASELINE=${MYPY_BASELINE:-51}
failed=0
if $py -m ruff check ml_flashpoint_nemo tests benchmarks examples; then echo "lint: ruff clean"; else echo "lint: ruff FAILED"; failed=1; fi
if $py -m mypy.stubtest ml_flashpoint_nemo._core --allowlist scripts/stubtest_allowlist.txt; then
  echo "lint: _core.pyi matches the extension"
else
  echo "lint: _core.pyi does not match the extension (stubtest) FAILED"; failed=1
fi
mypy_out=$($py -m mypy 2>&1)
errors=$(grep -c ': error:' <<<"$mypy_out" || true)
if [ "$errors" -le "$MYPY_BASELINE" ]; then
  echo "lint: mypy $errors error(s) (baseline $MYPY_BASELINE, target 0)"
else
  echo "$mypy_out"; echo "lint: mypy $errors error(s), more than the baseline $MYPY_BASELINE FAILED"; failed=1
fi
exit $failed
