#!/usr/bin/env bash
# Static checks, versions pinned in requirements/constraints.txt, settings in pyproject.toml:
# ruff (must be clean), mypy's stubtest of the C++ extension's stub (must match), and mypy on the
# package (must be clean: any error fails). Prints each result.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
failed=0
if $py -m ruff check ml_flashpoint_nemo tests benchmarks examples; then echo "lint: ruff clean"; else echo "lint: ruff FAILED"; failed=1; fi
if $py -m mypy.stubtest ml_flashpoint_nemo._core --allowlist scripts/stubtest_allowlist.txt \
    --mypy-config-file scripts/stubtest_mypy.ini; then
  echo "lint: _core.pyi matches the extension"
else
  echo "lint: _core.pyi does not match the extension (stubtest) FAILED"; failed=1
fi
if $py -m mypy; then echo "lint: mypy clean"; else echo "lint: mypy FAILED"; failed=1; fi
exit $failed
