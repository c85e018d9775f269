#!/usr/bin/env bash
# C++ line coverage of the extension: a gcov build (build/coverage-cpp) is swapped in for the
# installed _core while a test subset runs, then gcov reports per source file.
#
# Usage: bash scripts/coverage_cpp.sh [pytest arguments]   (default: the tests that drive _core)
# With FLASHPOINT_COVERAGE_GATE=1 it fails below 85% of lines.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
installed=$($py -c "import ml_flashpoint_nemo._core as c; print(c.__file__)")
build=$PWD/build/coverage-cpp
cmake -S . -B "$build" -DFLASHPOINT_COVERAGE=ON -DCMAKE_BUILD_TYPE=Debug \
  -DPython_EXECUTABLE="$PWD/$py" -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null
find "$build" -name '*.gcda' -delete
instrumented=$(ls "$build"/_core.*.so)

swap_in() { cp "$1" "$installed.swap" && mv -f "$installed.swap" "$installed"; }
cp "$installed" "$build/regular-core.so.bak"
trap 'swap_in "$build/regular-core.so.bak"' EXIT
swap_in "$instrumented"

status=0
if [ $# -eq 0 ]; then
  set -- tests/test_core_extension.py tests/test_transfer_service.py tests/test_hostile_objects.py \
    tests/test_roundtrip.py tests/test_peer_strings.py tests/test_transfer_authz.py tests/test_transfer_admission.py \
    tests/test_gmac.py tests/test_transfer_integrity.py
fi
$py -m pytest -q -p no:cacheprovider "$@" || status=$?
objects=$(find "$build" -name '*.gcda' -printf '%h\n' | sort -u)
$py - "$build" "${FLASHPOINT_COVERAGE_GATE:-0}" $objects <<'PY'
import os, re, subprocess, sys
build, gate, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
seen = {}
for directory in dirs:
    gcdas = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".gcda")]
    out = subprocess.run(["gcov", "-n", "-o", directory, *gcdas], capture_output=True, text=True).stdout
    for name, percent, total in re.findall(r"File '([^']+)'\nLines executed:([\d.]+)% of (\d+)", out):
        if "/csrc/" in name and name.endswith((".cpp", ".h", ".hpp")):
            executed = round(float(percent) * int(total) / 100)
            seen[name] = (executed, int(total))
executed = sum(e for e, _ in seen.values())
total = sum(t for _, t in seen.values())
for name, (e, t) in sorted(seen.items()):
    print(f"  {os.path.relpath(name):40s} {100.0 * e / max(t, 1):5.1f}% of {t}")
percent = 100.0 * executed / max(total, 1)
print(f"C++ coverage: lines {percent:.1f}% ({executed}/{total}); target 85%")
if gate == "1" and percent < 85:
    sys.exit("C++ coverage below its gate")
PY
exit $status
