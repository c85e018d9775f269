#!/usr/bin/env bash
# Sets up .venv with the pinned dependencies and builds the C++ extension.
# Safe to rerun: an existing .venv is reused and only what changed is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin=${PYTHON:-}
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
fi
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q -c requirements/constraints.txt)

# torch first and by its exact pin: an unpinned torch would pull a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
# Everything else in one resolve, against the same constraints.
"${pip[@]}" -e '.[nemo,dev]'
.venv/bin/python -c "import ml_flashpoint_nemo._core as c; print('ml_flashpoint_nemo ready, crc32c backend:', c.crc32c_backend())"
