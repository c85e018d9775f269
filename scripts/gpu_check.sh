#!/usr/bin/env bash
# GPU readiness in one go (about 5 minutes on one GPU): build, the CUDA tests, the staging benchmark.
#
# With .venv (scripts/setup.sh) its Python and extension are used. Without it (a bare GPU
# machine, no network) the extension is built with python3 into the source tree and the tests
# need only torch, pytest and hypothesis. Without a CUDA device the tests report as skipped and
# the benchmark is not run, so the script also runs in CI.
# Usage: bash scripts/gpu_check.sh [--size-gib N]   (default 4)
set -euo pipefail
cd "$(dirname "$0")/.."
size=4
if [ "${1:-}" = "--size-gib" ]; then size=$2; fi

if [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
  cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$py")" \
    -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" >/dev/null
  cmake --build build/gpu -j "$(nproc)" >/dev/null
  cp build/gpu/_core.*.so ml_flashpoint_nemo/
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from the source tree, for the benchmark too
fi
"$py" -c "import torch, ml_flashpoint_nemo._core as c; print('torch', torch.__version__, '| cuda:',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'none', '| crc32c:', c.crc32c_backend())"

tests=0
timeout 240 "$py" -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_cuda.py || tests=$?  # the benchmark runs anyway
if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  timeout 240 "$py" benchmarks/bench_core.py --device cuda --size-gib "$size" --runs 5
else
  echo "no CUDA device: bench_core.py --device cuda not run"
fi
exit "$tests"
