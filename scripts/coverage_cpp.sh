#!/usr/bin/env bash
# C++ line coverage of the extension: a gcov build (build/coverage-cpp) is swapped in for the
# installed _core while a test subset runs, then gcov reports per source file.
#
# Usage: bash scripts/coverage_cpp.sh [pytest arguments]   (default: the tests that drive _core)
# With FLASHPOINT_COVERAGE_GATE=1 it fails below 85% of lines.
# With FLASHPOINT_SANITIZE=1 the build also carries ASan + UBSan (every finding fatal), as
# scripts/sanitize.sh's does, and the default tests are both scripts' lists: one build and one run
# give both checks (what .ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
installed=$($py -c "import ml_flashpoint_nemo._core as c; print(c.__file__)")
sanitize=${FLASHPOINT_SANITIZE:-0}
build=$PWD/build/coverage-cpp
options=(-DFLASHPOINT_COVERAGE=ON)
if [ "$sanitize" = 1 ]; then
  build=$PWD/build/coverage-cpp-sanitize
  options+=(-DFLASHPOINT_SANITIZE=ON)
fi
cmake -S . -B "$build" "${options[@]}" -DCMAKE_BUILD_TYPE=Debug \
  -DPython_EXECUTABLE="$PWD/$py" -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null
find "$build" -name '*.gcda' -delete
instrumented=$(ls "$build"/_core.*.so)

swap_in() { cp "$1" "$installed.swap" && mv -f "$installed.swap" "$installed"; }
cp "$installed" "$build/regular-core.so.bak"
trap 'unset LD_PRELOAD ASAN_OPTIONS UBSAN_OPTIONS; swap_in "$build/regular-core.so.bak"' EXIT
swap_in "$instrumented"

if [ $# -eq 0 ]; then
  set -- tests/test_core_extension.py tests/test_transfer_service.py tests/test_hostile_objects.py \
    tests/test_roundtrip.py tests/test_peer_strings.py tests/test_transfer_authz.py tests/test_transfer_admission.py \
    tests/test_gmac.py tests/test_transfer_integrity.py tests/test_transfer_denial.py
  if [ "$sanitize" = 1 ]; then
    set -- "$@" tests/test_fuzz_objects.py tests/test_bad_inputs.py  # sanitize.sh's list has these too
  fi
fi
status=0
if [ "$sanitize" = 1 ]; then
  # As in sanitize.sh: the runtimes preloaded (Python is not instrumented), for the tests and their children only.
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
  # Reports go to files as well, so that a finding in a child process whose exit status a test ignores
  # (a peer it kills, a server it stops) still fails the run below.
  findings=$build/sanitizer-report
  rm -f "$findings".*
  export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:alloc_dealloc_mismatch=0:log_path=$findings
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$findings
  $py - "$installed" <<'PY'
import ctypes, sys
import ml_flashpoint_nemo._core as core
assert core.__file__ == sys.argv[1], core.__file__
ctypes.CDLL(None)["__asan_init"]  # the runtime is in the process
assert b"__asan_report" in open(core.__file__, "rb").read(), "the extension is not instrumented"
print("sanitized, gcov-instrumented _core in place:", core.__file__)
PY
fi
$py -m pytest -q -p no:cacheprovider "$@" || status=$?
unset LD_PRELOAD ASAN_OPTIONS UBSAN_OPTIONS  # gcov and the report below run plain
if [ "$sanitize" = 1 ] && compgen -G "$findings.*" >/dev/null; then
  echo "sanitizer findings (any process):"; cat "$findings".*
  status=1
fi
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
