#!/usr/bin/env bash
# Runs the core, loader and transfer tests against an ASan + UBSan build of the C++ extension.
#
# The sanitized _core is built in build/sanitize and swapped in for the one in .venv for the
# run; the regular build is put back on exit, whatever happens. Needs scripts/setup.sh first.
# Usage: bash scripts/sanitize.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
installed=$($py -c "import ml_flashpoint_nemo._core as c; print(c.__file__)" 2>/dev/null)
build=build/sanitize
cmake -S . -B "$build" -DFLASHPOINT_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$PWD/$py" -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null
sanitized=$(ls "$build"/_core.*.so)

# Swapped by rename (a new inode), never rewritten in place, so a process that has it mapped keeps its copy.
swap_in() { cp "$1" "$installed.swap" && mv -f "$installed.swap" "$installed"; }
cp "$installed" "$build/regular-core.so.bak"
trap 'swap_in "$build/regular-core.so.bak"' EXIT
swap_in "$sanitized"

# Python itself is not instrumented: the runtime is preloaded, and leaks of the interpreter and
# of torch are not ours to report. Child processes inherit both variables.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:alloc_dealloc_mismatch=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
$py - "$installed" <<'PY'
import ctypes, sys
import ml_flashpoint_nemo._core as core
assert core.__file__ == sys.argv[1], core.__file__
ctypes.CDLL(None)["__asan_init"]  # the runtime is in the process
assert b"__asan_report" in open(core.__file__, "rb").read(), "the extension is not instrumented"
print("sanitized _core in place:", core.__file__)
PY
$py -m pytest -q -p no:cacheprovider tests/test_core_extension.py tests/test_hostile_objects.py \
  tests/test_fuzz_objects.py tests/test_roundtrip.py tests/test_bad_inputs.py tests/test_transfer_service.py \
  tests/test_transfer_integrity.py tests/test_gmac.py "$@"
