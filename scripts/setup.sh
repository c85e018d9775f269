#!/usr/bin/env bash
# Sets up .venv with the pinned dependencies and builds the C++ extension.
# Safe to rerun: an existing .venv is reused and only what changed is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# The C++ extension links OpenSSL's libcrypto (3.0 or later) for every primitive of the transfer
# protocol and needs its headers to build; benchmarks/bench_tls_psk.py (and its smoke test) compiles
# a helper against libssl. Both come in one package. As root with apt-get or dnf they are installed
# here; otherwise a missing one stops the set-up with what to install. OPENSSL_ROOT_DIR (another
# installation, for CMake) skips the check.
openssl_headers() {
  pkg-config --exists 'libcrypto >= 3.0' 'libssl >= 3.0' 2>/dev/null ||
    { [ -f /usr/include/openssl/evp.h ] && [ -f /usr/include/openssl/ssl.h ]; }
}
if [ -z "${OPENSSL_ROOT_DIR:-}" ] && ! openssl_headers; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing OpenSSL's headers (libssl-dev) for the C++ extension and the TLS benchmark"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libssl-dev >/dev/null
  elif [ "$(id -u)" = 0 ] && command -v dnf >/dev/null 2>&1; then
    echo "installing OpenSSL's headers (openssl-devel) for the C++ extension and the TLS benchmark"
    dnf install -y -q openssl-devel >/dev/null
  fi
  if ! openssl_headers; then
    echo "error: OpenSSL 3's headers (openssl/evp.h, openssl/ssl.h) are missing; the C++ extension needs" >&2
    echo "  libcrypto's, benchmarks/bench_tls_psk.py libssl's." >&2
    echo "  Install them, then rerun: Debian/Ubuntu 'apt-get install libssl-dev'," >&2
    echo "  RHEL/Rocky/Fedora 'dnf install openssl-devel'; or set OPENSSL_ROOT_DIR to another OpenSSL 3." >&2
    exit 1
  fi
fi

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
.venv/bin/python -c "import ml_flashpoint_nemo._core as c; print('ml_flashpoint_nemo ready, crc32c backend:', c.crc32c_backend(), '| crypto:', c.crypto_library())"
