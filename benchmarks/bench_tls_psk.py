"""TLS 1.3 with an external pre-shared key against raw TCP and our push, over loopback (issue 31).

Issue 31 asks whether a standard secure channel could replace our wire protocol (AES-256-GMAC
tags from libcrypto, payload in the clear, docs/protocol.md) within the replication budget:
steady push >= 0.7x raw TCP and CPU per GB <= 1.5x raw TCP's. Python's ssl module has no PSK
callbacks, so the TLS ends are a small C program (tls_psk_pipe.c, next to this file), compiled
here with the system C compiler against OpenSSL's libssl: one TLS 1.3 session per run whose
only key is an external PSK (the per-rank-pair key a job would derive), no certificate.

Kinds, run interleaved round by round (every kind once per round, same order):

- raw_tcp: references.raw_tcp_throughput, the denominator of every ratio here and in
  bench_replication_transport.py (two Python threads, one cache-resident 256 KiB buffer).
- raw_tcp_c: the same in C, with each end's CPU time; tls_aes256 / tls_aes128: TLS 1.3 PSK with
  TLS_AES_256_GCM_SHA384 / TLS_AES_128_GCM_SHA256 in user space (SSL_write / SSL_read), same shape.
- raw_files_c, tls_aes256_files, tls_aes128_files: what a push moves: the sender pread()s each
  256 KiB chunk of a real object (saved by CheckpointSaver) and sends it, the receiver reads
  straight into a shared mapping of a replica file whose pages are already there and mapped
  before the timer starts (a steady push's spare and kept mapping). No CRC32C on either end,
  which our push computes on the receiver.
- push: our steady push (bench_replication_transport's, the default path: tags from a buffer).
- ktls_aes256_sendfile: the TLS session handed to the kernel (SSL_OP_ENABLE_KTLS) and the object
  sent with SSL_sendfile(); run only where the kernel offers the "tls" upper-layer protocol
  (probed with setsockopt(TCP_ULP, "tls") on a loopback connection; the reason is printed if not).

Per end, CPU seconds per GB moved (the scheduler's exact runtime, CLOCK_THREAD_CPUTIME_ID and
CLOCK_PROCESS_CPUTIME_ID, not getrusage, which a tick-accounting kernel rounds): the C ends
each thread's (the handshake excluded), our push's sender its calling thread's and its receiver
the rest of the process's; raw_tcp has only the process total. File copies are compared with the source
once, after the warm-up. Prints one JSON object.

    python benchmarks/bench_tls_psk.py [--mib 256] [--rounds 5]

Needs a C compiler ($CC, cc, gcc or clang) and OpenSSL 3's libssl headers (libssl-dev on
Debian/Ubuntu, openssl-devel on RHEL/Fedora; scripts/setup.sh installs or checks them).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from references import raw_tcp_throughput

HERE = Path(__file__).resolve().parent
HELPER_SOURCE = HERE / "tls_psk_pipe.c"
CHUNK = 256 << 10
TCP_ULP = 31  # linux/tcp.h; Python's socket module has no name for it
BUDGET_THROUGHPUT_RATIO = 0.7
BUDGET_CPU_RATIO = 1.5
HELPER_KINDS = {  # kind: (mode, cipher, with files)
    "raw_tcp_c": ("raw", "aes256", False),
    "tls_aes256": ("tls", "aes256", False),
    "tls_aes128": ("tls", "aes128", False),
    "raw_files_c": ("raw", "aes256", True),
    "tls_aes256_files": ("tls", "aes256", True),
    "tls_aes128_files": ("tls", "aes128", True),
    "ktls_aes256_sendfile": ("ktls", "aes256", True),
}
SUITES = {"aes256": "TLS_AES_256_GCM_SHA384", "aes128": "TLS_AES_128_GCM_SHA256"}


class SetupError(SystemExit):
    """What this machine lacks to build the TLS helper, with what to install."""


def compiler() -> str:
    """The C compiler to build the helper with."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise SetupError("error: no C compiler (cc, gcc or clang) found; the TLS helper is C. Install one "
                     "(Debian/Ubuntu 'apt-get install gcc', RHEL/Fedora 'dnf install gcc') or set CC.")


def build_helper(out_dir: Path) -> Path:
    """Compile tls_psk_pipe.c against libssl and libcrypto; a missing header or library says what to install."""
    binary = out_dir / "tls_psk_pipe"
    command = [compiler(), "-O2", "-Wall", "-o", os.fspath(binary), os.fspath(HELPER_SOURCE), "-lssl", "-lcrypto",
               "-lpthread"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        if "openssl/" in result.stderr or "-lssl" in result.stderr or "-lcrypto" in result.stderr:
            raise SetupError("error: OpenSSL 3's libssl headers or library are missing (openssl/ssl.h, libssl.so); "
                             "the TLS helper needs them. Install them, then rerun: Debian/Ubuntu 'apt-get install "
                             f"libssl-dev', RHEL/Rocky/Fedora 'dnf install openssl-devel'.\n{result.stderr}")
        raise SetupError(f"error: compiling {HELPER_SOURCE.name} failed:\n{result.stderr}")
    return binary


def kernel_tls() -> dict:
    """Whether the kernel takes a connected TCP socket's TLS (TCP_ULP "tls"), and what the probe said."""
    try:
        available = Path("/proc/sys/net/ipv4/tcp_available_ulp").read_text().split()
    except OSError:
        available = []
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        peer, _ = listener.accept()
        with peer:
            try:
                client.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
            except OSError as error:
                name = errno.errorcode.get(error.errno or 0, str(error.errno))
                return {"available": False, "tcp_available_ulp": available,
                        "probe": f"setsockopt(TCP_ULP, 'tls') failed: {name} ({error.strerror})"}
    return {"available": True, "tcp_available_ulp": available, "probe": "setsockopt(TCP_ULP, 'tls') succeeded"}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def run_helper(binary: Path, kind: str, nbytes: int, src: Path, dst: Path) -> dict:
    """One helper run; returns its seconds, per-end CPU and what the TLS session negotiated."""
    mode, cipher, files = HELPER_KINDS[kind]
    command = [os.fspath(binary), mode, cipher, str(nbytes), str(CHUNK)]
    if files:
        command += [os.fspath(src), os.fspath(dst)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{kind}: {' '.join(command)} failed: {result.stderr.strip()}")
    report = json.loads(result.stdout)
    if mode != "raw":
        for end in ("sender", "receiver"):
            session = report[end]
            if session["version"] != "TLSv1.3" or session["cipher"] != SUITES[cipher] or not session["psk_used"]:
                raise RuntimeError(f"{kind}: the {end} negotiated {session}, not TLS 1.3 with {SUITES[cipher]} "
                                   "on the external PSK")
    if mode == "ktls" and not report["sender"]["ktls_send"]:
        raise RuntimeError(f"{kind}: the kernel offers TLS but libssl did not hand the send side to it "
                           "(libssl built without KTLS?)")
    return {"seconds": report["seconds"],
            "sender_cpu_s": report["sender"]["cpu_s"],
            "receiver_cpu_s": report["receiver"]["cpu_s"],
            "handshake_s": max(report["sender"]["handshake_s"], report["receiver"]["handshake_s"]),
            "ktls": [report["sender"]["ktls_send"], report["receiver"]["ktls_recv"]],
            "openssl": report["openssl"]}


def run_python(measure: Callable[[], float], nbytes: int, per_end: bool) -> dict:
    """A transfer in this process: measure() returns bytes per second; CPU split by the calling thread."""
    process, thread = time.process_time(), time.thread_time()
    rate = measure()
    process, thread = time.process_time() - process, time.thread_time() - thread
    row: dict = {"seconds": nbytes / rate, "total_cpu_s": process}
    if per_end:
        row.update(sender_cpu_s=thread, receiver_cpu_s=process - thread)
    return row


def zero_fill(path: Path, nbytes: int) -> None:
    """Overwrite in place (the pages stay allocated, as a spare's do)."""
    zeros = bytes(1 << 20)
    with open(path, "r+b") as f:
        for offset in range(0, nbytes, len(zeros)):
            os.pwrite(f.fileno(), zeros[:min(len(zeros), nbytes - offset)], offset)


def same_bytes(a: Path, b: Path, nbytes: int) -> bool:
    """Whether the first nbytes of a and b are equal (an object file can be longer than its record says)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for offset in range(0, nbytes, 1 << 22):
            step = min(1 << 22, nbytes - offset)
            x, y = fa.read(step), fb.read(step)
            if len(x) != step or x != y:
                return False
    return True


def _stats(values: list[float], digits: int = 3) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def summarize(rows: dict[str, list[dict]], nbytes: int) -> dict:
    """Per kind: GB/s and CPU s per GB (per end where known), and per-round ratios to raw_tcp."""
    gb = nbytes / 1e9
    raw = rows["raw_tcp"]
    out = {}
    for kind, runs in rows.items():
        totals = [r.get("total_cpu_s", r.get("sender_cpu_s", 0.0) + r.get("receiver_cpu_s", 0.0)) for r in runs]
        entry = {"gb_per_s": _stats([gb / r["seconds"] for r in runs]),
                 "cpu_s_per_gb_total": _stats([t / gb for t in totals]),
                 "ratio_gb_per_s_vs_raw_tcp": _stats([b["seconds"] / r["seconds"] for r, b in zip(runs, raw)]),
                 "ratio_cpu_vs_raw_tcp": _stats([t / b["total_cpu_s"] for t, b in zip(totals, raw)])}
        if "sender_cpu_s" in runs[0]:
            entry["cpu_s_per_gb_sender"] = _stats([r["sender_cpu_s"] / gb for r in runs])
            entry["cpu_s_per_gb_receiver"] = _stats([r["receiver_cpu_s"] / gb for r in runs])
        if "handshake_s" in runs[0]:
            entry["handshake_ms"] = _stats([r["handshake_s"] * 1e3 for r in runs], 2)
        entry["meets_budget"] = (entry["ratio_gb_per_s_vs_raw_tcp"]["median"] >= BUDGET_THROUGHPUT_RATIO
                                 and entry["ratio_cpu_vs_raw_tcp"]["median"] <= BUDGET_CPU_RATIO)
        out[kind] = entry
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="object size in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds, every kind once each (default 5)")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs for the object and the replicas")
    args = parser.parse_args(argv)
    ktls = kernel_tls()
    load_before = [round(x, 2) for x in os.getloadavg()]
    root = Path(tempfile.mkdtemp(prefix="flashpoint-bench-tls-", dir=args.dir))
    try:
        binary = build_helper(root)  # before torch's import: a machine without libssl hears it at once
        from ml_flashpoint_nemo import _core
        from ml_flashpoint_nemo.core.layout import REPLICA_SPARES

        from bench_replication_transport import SECRET, Endpoints, _push

        ends = Endpoints(os.fspath(root / "bases"), args.mib << 20)
        nbytes, src = ends.record.nbytes, ends.object_path
        dst = ends.dst.base_dir / "tls-replica.bin"
        with open(dst, "wb") as f:
            f.truncate(nbytes)
        zero_fill(dst, nbytes)
        kinds = ["raw_tcp", "raw_tcp_c", "tls_aes256", "tls_aes128", "raw_files_c", "tls_aes256_files",
                 "tls_aes128_files", "push"] + (["ktls_aes256_sendfile"] if ktls["available"] else [])
        rows: dict[str, list[dict]] = {k: [] for k in kinds}
        verified = []
        with _core.TransferServer(os.fspath(ends.dst.base_dir), SECRET, max_connections=2,
                                  spare_dir=REPLICA_SPARES) as steady:
            runs: dict[str, Callable[[], dict]] = {
                "raw_tcp": lambda: run_python(lambda: raw_tcp_throughput(nbytes)["bytes_per_s"], nbytes, False),
                "push": lambda: run_python(lambda: _push(ends, steady.port, known_crc=True, zero_copy=False,
                                                         spare=True), nbytes, True),
                **{k: (lambda k=k: run_helper(binary, k, nbytes, src, dst)) for k in HELPER_KINDS},
            }
            for kind in kinds:  # warm-up; each copy into the replica file is checked once
                if kind in HELPER_KINDS and HELPER_KINDS[kind][2]:
                    zero_fill(dst, nbytes)
                    runs[kind]()
                    if not same_bytes(src, dst, nbytes):
                        raise RuntimeError(f"{kind}: the replica differs from the object")
                    verified.append(kind)
                else:
                    runs[kind]()
            for _ in range(args.rounds):
                for kind in kinds:
                    rows[kind].append(runs[kind]())
            server_errors = steady.errors()
        openssl = next(r["openssl"] for k, v in rows.items() if k in HELPER_KINDS for r in v)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "openssl": openssl,
        "object_nbytes": nbytes,
        "chunk_bytes": CHUNK,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "kernel_tls": ktls,
        "verified_copies": verified,
        "budget": {"throughput_ratio_at_least": BUDGET_THROUGHPUT_RATIO, "cpu_ratio_at_most": BUDGET_CPU_RATIO},
        "kinds": summarize(rows, nbytes),
        "server_errors": server_errors,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    try:
        main()
    except SetupError as error:
        print(error.code, file=sys.stderr)
        sys.exit(2)
