// Python bindings of the transfer service: TransferServer, push/fetch and the transfer errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include "bindings_common.hpp"
#include "crypto.hpp"
#include "transfer.hpp"
#include "transfer_mac.hpp"
#include "transfer_policy.hpp"

namespace flashpoint {
namespace bindings {
namespace {

// The Python classes of the transfer errors, most derived first (set once at import).
struct TransferErrorClass {
  PyObject* type;
  bool (*matches)(const TransferError&);
};
template <typename T>
bool is_a(const TransferError& e) {
  return dynamic_cast<const T*>(&e) != nullptr;
}
bool any_transfer_error(const TransferError&) { return true; }  // the base class: the last entry, matches all
std::vector<TransferErrorClass>& transfer_error_classes() {
  static std::vector<TransferErrorClass> classes;
  return classes;
}

// Raises a transfer error as its Python class with the message made printable_text.
void translate_transfer_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const TransferError& e) {
    for (const TransferErrorClass& c : transfer_error_classes()) {
      if (c.matches(e)) {
        PyErr_SetString(c.type, printable_text(e.what()).c_str());
        return;
      }
    }
    throw;
  }
}

std::string fspath(const py::object& path) {
  return py::module_::import("os").attr("fspath")(path).cast<std::string>();
}

std::string buffer_bytes(const py::buffer& data) {
  py::buffer_info info = request_readable(data);
  return std::string(static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
}

// The peer-facing options every client call takes: ranks and the minimum rate.
struct PeerArgs {
  uint32_t rank;
  uint32_t peer_rank;
  double min_rate_bytes_per_s;
  py::object rate_grace_s;
};

void set_peer_args(TransferOptions& o, const PeerArgs& a) {
  o.rank = a.rank;
  o.peer_rank = a.peer_rank;
  o.min_rate_bytes_per_s = a.min_rate_bytes_per_s;
  o.rate_grace_s = a.rate_grace_s.is_none() ? -1.0 : a.rate_grace_s.cast<double>();
  if (!a.rate_grace_s.is_none() && !(o.rate_grace_s >= 0)) throw std::invalid_argument("rate_grace_s must be >= 0 or None");
}

TransferOptions transfer_options(double connect_timeout_s, double io_timeout_s, int retries, double backoff_s,
                                 bool zero_copy, uint64_t max_object_bytes) {
  TransferOptions o;
  o.connect_timeout_s = connect_timeout_s;
  o.io_timeout_s = io_timeout_s;
  o.retries = retries;
  o.backoff_s = backoff_s;
  o.zero_copy = zero_copy;
  o.max_object_bytes = max_object_bytes;
  return o;
}

// A known CRC32C passed from Python (None: the sender computes it while sending).
void set_known_crc(TransferOptions& o, const py::object& crc) {
  if (crc.is_none()) return;
  const long long value = crc.cast<long long>();
  if (value < 0 || value > 0xFFFFFFFFLL) throw std::invalid_argument("crc32c must be in 0..2**32-1 or None");
  o.has_known_crc = true;
  o.known_crc = static_cast<uint32_t>(value);
}

std::string optional_relative_path(const py::object& path) {
  if (path.is_none()) return std::string();
  const std::string p = fspath(path);
  split_relative_path(p);  // TransferPathError (a ValueError) naming it
  return p;
}

// An allow-list from Python: None (every address) or an iterable of numeric addresses.
std::pair<bool, std::vector<std::string>> allow_list(const py::object& addresses) {
  if (addresses.is_none()) return {true, {}};
  if (py::isinstance<py::str>(addresses) || py::isinstance<py::bytes>(addresses))
    throw py::type_error("allowed_peers must be None or a list of addresses, not one string");
  std::vector<std::string> out;
  for (const py::handle& a : addresses) out.push_back(a.cast<std::string>());
  return {false, out};
}

py::object allow_list_object(const std::pair<bool, std::vector<std::string>>& allowed) {
  if (allowed.first) return py::none();
  return py::cast(allowed.second);
}

py::dict transfer_result(const TransferResult& r) {
  py::dict d;
  d["nbytes"] = r.nbytes;
  d["crc32c"] = r.crc32c;
  d["attempts"] = r.attempts;
  d["seconds"] = r.seconds;
  return d;
}

}  // namespace

void register_transfer(py::module_& m) {
  // Registered base first: pybind11 tries the newest translator first, so subclasses win.
  // Every error of the package derives from ml_flashpoint_nemo.errors.FlashpointError; this
  // module is imported from there after FlashpointError is defined, so the lookup finds it.
  py::object flashpoint_error = py::module_::import("ml_flashpoint_nemo.errors").attr("FlashpointError");
  py::tuple transfer_bases = py::make_tuple(flashpoint_error, py::handle(PyExc_OSError));
  auto& transfer_error = py::register_exception<TransferError>(m, "TransferError", transfer_bases);
  transfer_error.doc() =
      "A transfer failed (client operations: after the last retry). Subclass of FlashpointError and OSError.";
  auto& auth_error = py::register_exception<TransferAuthError>(m, "TransferAuthError", transfer_error);
  auth_error.doc() = "The peer failed the HMAC-SHA256 handshake (wrong job secret). Never retried.";
  py::tuple timeout_bases = py::make_tuple(transfer_error, py::handle(PyExc_TimeoutError));
  py::register_exception<TransferTimeoutError>(m, "TransferTimeoutError", timeout_bases).doc() =
      "Connect, send or receive ran past its timeout (after the last retry). Also a TimeoutError.";
  py::register_exception<TransferChecksumError>(m, "TransferChecksumError", transfer_error).doc() =
      "Length or CRC32C of the received bytes did not match the sender's; nothing was renamed into place.";
  py::register_exception<TransferIntegrityError>(m, "TransferIntegrityError", transfer_error).doc() =
      "An authenticated message (request, response, data chunk or trailer) failed its tag check: the "
      "connection was tampered with or corrupted on the way. Nothing was stored. Never retried.";
  auto& refused = py::register_exception<TransferRefusedError>(m, "TransferRefusedError", transfer_error);
  refused.doc() = "The peer refused the request (too large, I/O error on its side, ...). Never retried.";
  py::register_exception<TransferNotFoundError>(m, "TransferNotFoundError", refused).doc() =
      "The requested object does not exist on the serving peer.";
  py::tuple forbidden_bases = py::make_tuple(refused, py::handle(PyExc_PermissionError));
  py::register_exception<TransferForbiddenError>(m, "TransferForbiddenError", forbidden_bases).doc() =
      "The serving peer's policy does not let this rank push or fetch that path (not what the replication\n"
      "placement sends there, not a name of the checkpoint layout, a size its commit record contradicts).\n"
      "Never retried. Also a PermissionError.";
  py::register_exception<TransferNoSpaceError>(m, "TransferNoSpaceError", refused).doc() =
      "The receiver has no room for the object (free space minus the receptions in flight and the margin it\n"
      "keeps for its own saves). Nothing was stored; not retried.";
  py::tuple path_bases = py::make_tuple(refused, py::handle(PyExc_ValueError));
  py::register_exception<TransferPathError>(m, "TransferPathError", path_bases).doc() =
      "An object path was refused (absolute, '..', empty component, NUL, too long, or resolving through a "
      "symlink / non-directory). Also a ValueError; the message names the path.";
  // Registered last, so it is tried first: the same classes, with the message escaped.
  transfer_error_classes() = {
      {m.attr("TransferPathError").ptr(), is_a<TransferPathError>},
      {m.attr("TransferNotFoundError").ptr(), is_a<TransferNotFoundError>},
      {m.attr("TransferForbiddenError").ptr(), is_a<TransferForbiddenError>},
      {m.attr("TransferNoSpaceError").ptr(), is_a<TransferNoSpaceError>},
      {m.attr("TransferRefusedError").ptr(), is_a<TransferRefusedError>},
      {m.attr("TransferChecksumError").ptr(), is_a<TransferChecksumError>},
      {m.attr("TransferIntegrityError").ptr(), is_a<TransferIntegrityError>},
      {m.attr("TransferTimeoutError").ptr(), is_a<TransferTimeoutError>},
      {m.attr("TransferAuthError").ptr(), is_a<TransferAuthError>},
      {m.attr("TransferError").ptr(), any_transfer_error},
  };
  py::register_exception_translator(translate_transfer_error);

  m.def("crypto_library", [] { return std::string(crypto_library()); },
        "The OpenSSL libcrypto that computes every tag, key and nonce of the transfer protocol, e.g. "
        "'OpenSSL 3.0.19 27 Jan 2026'.");
  m.def(
      "gmac",
      [](const py::buffer& key, const py::buffer& nonce, const py::list& parts) {
        const std::string k = buffer_bytes(key), n = buffer_bytes(nonce);
        if (k.size() != kGmacKeyBytes) throw std::invalid_argument("key must be 32 bytes (AES-256)");
        if (n.size() != kGmacNonceBytes) throw std::invalid_argument("nonce must be 12 bytes");
        std::vector<py::buffer_info> pieces;  // held (and the parts with them) while the GIL is released
        for (const py::handle& part : parts) pieces.push_back(request_readable(py::reinterpret_borrow<py::buffer>(part)));
        GmacTag tag;
        {
          py::gil_scoped_release release;
          Gmac g(reinterpret_cast<const uint8_t*>(k.data()));
          g.begin(reinterpret_cast<const uint8_t*>(n.data()));
          for (const py::buffer_info& piece : pieces) g.update(piece.ptr, static_cast<size_t>(piece.size * piece.itemsize));
          tag = g.finish();
        }
        return py::bytes(reinterpret_cast<const char*>(tag.data()), tag.size());
      },
      py::arg("key"), py::arg("nonce"), py::arg("parts"),
      "AES-256-GMAC tag (16 bytes, libcrypto's AES-256-GCM with the parts as additional data) of the "
      "concatenated parts, fed one part at a time, under key (32 bytes) and nonce (12 bytes). For the test vectors.");
  m.def(
      "hmac_sha256", [](const py::buffer& key, const py::buffer& msg) {
        const std::string k = buffer_bytes(key), d = buffer_bytes(msg);
        const Digest256 mac = hmac_sha256(k.data(), k.size(), d.data(), d.size());
        return py::bytes(reinterpret_cast<const char*>(mac.data()), mac.size());
      },
      py::arg("key"), py::arg("msg"), "HMAC-SHA256 (RFC 2104, libcrypto) of msg under key. For the test vectors.");

  constexpr uint64_t kDefaultMax = kTransferDefaultMaxObjectBytes;
  m.def(
      "transfer_push",
      [](const std::string& host, int port, const py::bytes& secret, const py::object& local_base_dir,
         const std::string& path, const py::object& remote_path, double connect_timeout_s, double io_timeout_s,
         int retries, double backoff_s, bool zero_copy, const py::object& crc32c, uint32_t rank, uint32_t peer_rank,
         double min_rate_bytes_per_s, const py::object& rate_grace_s) {
        const std::string base = fspath(local_base_dir);
        const std::string remote = remote_path.is_none() ? std::string() : remote_path.cast<std::string>();
        if (!remote_path.is_none()) split_relative_path(remote);  // an explicit "" is refused, not defaulted
        const std::string key = secret;
        TransferOptions o = transfer_options(connect_timeout_s, io_timeout_s, retries, backoff_s, zero_copy, kDefaultMax);
        set_known_crc(o, crc32c);
        set_peer_args(o, {rank, peer_rank, min_rate_bytes_per_s, rate_grace_s});
        TransferResult r;
        {
          py::gil_scoped_release release;
          r = transfer_push_path(host, port, key, base, path, remote, o);
        }
        return transfer_result(r);
      },
      py::arg("host"), py::arg("port"), py::arg("secret"), py::arg("local_base_dir"), py::arg("path"),
      py::arg("remote_path") = py::none(), py::kw_only(), py::arg("connect_timeout_s") = 5.0,
      py::arg("io_timeout_s") = 30.0, py::arg("retries") = 3, py::arg("backoff_s") = 0.2,
      py::arg("zero_copy") = false, py::arg("crc32c") = py::none(), py::arg("rank") = 0, py::arg("peer_rank") = 0,
      py::arg("min_rate_bytes_per_s") = kTransferDefaultMinRate, py::arg("rate_grace_s") = py::none(),
      "Push local_base_dir/path to a TransferServer as remote_path (default: path).\n\n"
      "Both paths are relative and confined (no absolute path, '..', empty component, NUL, symlink).\n"
      "The server stores the object atomically (hidden temp file, CRC32C + length check, fsync, rename).\n"
      "Connect failures, timeouts, lost connections and checksum mismatches are retried `retries` times,\n"
      "sleeping backoff_s * 2**i before retry i; authentication failures and refusals are not.\n"
      "Each 256 KiB chunk is pread and tagged (AES-256-GMAC), then sent from that buffer with send();\n"
      "zero_copy=True sends it with sendfile() instead, which costs more CPU here: the bytes were read for\n"
      "the tag anyway, and sendfile's page-sized pieces make more, smaller segments for both ends.\n"
      "crc32c: the CRC32C of the bytes being sent when the caller knows it (e.g. from the object's\n"
      "index): it is then not computed here; the receiver still checks the bytes against it and\n"
      "refuses them (TransferChecksumError, nothing stored) when they differ.\n"
      "rank: the rank this side proves in the handshake; peer_rank: the rank the server must prove (else\n"
      "TransferAuthError). Once the data flows the transfer must average min_rate_bytes_per_s after its first\n"
      "rate_grace_s seconds (None: io_timeout_s), else TransferTimeoutError; 0 turns the floor off.\n"
      "Returns {'nbytes', 'crc32c', 'attempts', 'seconds'}. Raises TransferAuthError, TransferPathError\n"
      "(also ValueError), TransferForbiddenError (also PermissionError), TransferNoSpaceError,\n"
      "TransferNotFoundError, TransferRefusedError, TransferChecksumError,\n"
      "TransferTimeoutError (also TimeoutError), TransferError (base, an OSError); ValueError for bad\n"
      "arguments (secret under 16 bytes, bad port, timeouts <= 0); OSError for local file errors.");
  m.def(
      "transfer_push_fd",
      [](const std::string& host, int port, const py::bytes& secret, int fd, const std::string& remote_path,
         uint64_t offset, const py::object& length, double connect_timeout_s, double io_timeout_s, int retries,
         double backoff_s, bool zero_copy, const py::object& crc32c, uint32_t rank, uint32_t peer_rank,
         double min_rate_bytes_per_s, const py::object& rate_grace_s) {
        const std::string key = secret;
        const uint64_t n = length.is_none() ? UINT64_MAX : length.cast<uint64_t>();
        TransferOptions o = transfer_options(connect_timeout_s, io_timeout_s, retries, backoff_s, zero_copy, kDefaultMax);
        set_known_crc(o, crc32c);
        set_peer_args(o, {rank, peer_rank, min_rate_bytes_per_s, rate_grace_s});
        TransferResult r;
        {
          py::gil_scoped_release release;
          r = transfer_push_fd(host, port, key, fd, offset, n, remote_path, o);
        }
        return transfer_result(r);
      },
      py::arg("host"), py::arg("port"), py::arg("secret"), py::arg("fd"), py::arg("remote_path"), py::kw_only(),
      py::arg("offset") = 0, py::arg("length") = py::none(), py::arg("connect_timeout_s") = 5.0,
      py::arg("io_timeout_s") = 30.0, py::arg("retries") = 3, py::arg("backoff_s") = 0.2,
      py::arg("zero_copy") = false, py::arg("crc32c") = py::none(), py::arg("rank") = 0, py::arg("peer_rank") = 0,
      py::arg("min_rate_bytes_per_s") = kTransferDefaultMinRate, py::arg("rate_grace_s") = py::none(),
      "Like transfer_push, but sends bytes [offset, offset+length) of an open regular file (length None:\n"
      "to the end). The file position is not used or changed. crc32c, when given, is the CRC32C of\n"
      "exactly those bytes.");
  m.def(
      "transfer_fetch",
      [](const std::string& host, int port, const py::bytes& secret, const std::string& remote_path,
         const py::object& local_base_dir, const py::object& local_path, double connect_timeout_s,
         double io_timeout_s, int retries, double backoff_s, uint64_t max_object_bytes, const py::object& spare_dir,
         uint32_t rank, uint32_t peer_rank, double min_rate_bytes_per_s, const py::object& rate_grace_s,
         const py::object& space_margin_bytes) {
        const std::string base = fspath(local_base_dir);
        const std::string local = local_path.is_none() ? std::string() : local_path.cast<std::string>();
        if (!local_path.is_none()) split_relative_path(local);  // an explicit "" is refused, not defaulted
        const std::string key = secret;
        TransferOptions o = transfer_options(connect_timeout_s, io_timeout_s, retries, backoff_s, true, max_object_bytes);
        o.spare_dir = optional_relative_path(spare_dir);
        set_peer_args(o, {rank, peer_rank, min_rate_bytes_per_s, rate_grace_s});
        if (!space_margin_bytes.is_none()) {
          o.space_margin_bytes = space_margin_bytes.cast<int64_t>();
          if (o.space_margin_bytes < 0) throw std::invalid_argument("space_margin_bytes must be >= 0 or None");
        }
        TransferResult r;
        {
          py::gil_scoped_release release;
          r = transfer_fetch(host, port, key, remote_path, base, local, o);
        }
        return transfer_result(r);
      },
      py::arg("host"), py::arg("port"), py::arg("secret"), py::arg("remote_path"), py::arg("local_base_dir"),
      py::arg("local_path") = py::none(), py::kw_only(), py::arg("connect_timeout_s") = 5.0,
      py::arg("io_timeout_s") = 30.0, py::arg("retries") = 3, py::arg("backoff_s") = 0.2,
      py::arg("max_object_bytes") = kDefaultMax, py::arg("spare_dir") = py::none(), py::arg("rank") = 0,
      py::arg("peer_rank") = 0, py::arg("min_rate_bytes_per_s") = kTransferDefaultMinRate,
      py::arg("rate_grace_s") = py::none(), py::arg("space_margin_bytes") = py::none(),
      "Fetch remote_path from a TransferServer into local_base_dir/local_path (default: remote_path).\n\n"
      "Missing parent directories are created inside local_base_dir. The object is received into a hidden\n"
      "temp file, checked (length, CRC32C), fsynced and renamed into place only if it matches. Retries and\n"
      "errors as transfer_push; objects over max_object_bytes are refused. spare_dir (relative to\n"
      "local_base_dir, same file system): a directory of spare files; the temp file is one of them when\n"
      "there is one (renamed, resized, overwritten), so the data lands on tmpfs pages that already exist.\n"
      "rank, peer_rank, min_rate_bytes_per_s, rate_grace_s: as transfer_push. Before the data flows the\n"
      "object's bytes are reserved on local_base_dir's file system (against this process's other fetches),\n"
      "leaving space_margin_bytes free (None: 1/32 of the file system) for this node's own saves, as a\n"
      "TransferServer does; TransferNoSpaceError (nothing written, not retried) when they do not fit.");

  py::class_<TransferPolicy, std::shared_ptr<TransferPolicy>>(
      m, "TransferPolicy",
      "What each authenticated rank may do on a TransferServer (decided in C++ for every request).\n\n"
      "Paths are <version dir>/<name>: the version directory as version_dir_pattern writes it, the name\n"
      "an object as object_name_pattern writes it or one of version_files (str.format patterns with\n"
      "{step}, {rank} and {index}, e.g. '{rank:05d}'; names match only in that canonical form). A rank\n"
      "may push only objects of the ranks pushers grants it (client rank -> object ranks), never an\n"
      "object of own_ranks (this node's) and never a version file; pushes create no directory but\n"
      "the version directory. Any rank below world_size may fetch objects and version files.")
      .def(py::init([](uint32_t world_size, const std::vector<uint32_t>& own_ranks,
                       const std::map<uint32_t, std::vector<uint32_t>>& pushers, const std::string& version_dir_pattern,
                       const std::string& object_name_pattern, const std::vector<std::string>& version_files) {
             TransferPolicyConfig c;
             c.world_size = world_size;
             c.own_ranks = own_ranks;
             c.pushers = pushers;
             c.version_dir_pattern = version_dir_pattern;
             c.object_name_pattern = object_name_pattern;
             c.version_files = version_files;
             return std::make_shared<TransferPolicy>(c);
           }),
           py::kw_only(), py::arg("world_size"), py::arg("own_ranks"), py::arg("pushers"),
           py::arg("version_dir_pattern"), py::arg("object_name_pattern"), py::arg("version_files"))
      .def_property_readonly("world_size", &TransferPolicy::world_size)
      .def("__repr__", &TransferPolicy::describe);

  py::class_<TransferServer>(m, "TransferServer",
                             "Serves PUSH and FETCH of checkpoint objects under base_dir to authenticated peers.\n\n"
                             "One admission thread accepts connections and runs every handshake (non-blocking),\n"
                             "so a peer that does not prove a rank of the job never occupies a worker; the rank\n"
                             "it proved travels with the connection to the worker, whose policy checks every\n"
                             "request against it. A connection whose address is not in allowed_peers (None: any)\n"
                             "is closed before a byte is read or written; at most\n"
                             "max_connections_per_peer connections per address (handshaking, queued or served); at\n"
                             "most max_handshakes handshaking at once (when full, a new connection displaces the\n"
                             "oldest handshake of the address with the most); a handshake not completed within\n"
                             "handshake_timeout_s of accept() is closed. The request must then arrive whole within\n"
                             "request_timeout_s, and its tag is checked before any field of it is used, still in the\n"
                             "stage. max_connections worker threads serve the authenticated requests; up to\n"
                             "max_pending more wait in a queue for at most queue_timeout_s, beyond that they are\n"
                             "closed unserved. A rank has at most max_queued_per_rank requests waiting in the queue\n"
                             "(0: max(1, min(4, max_pending / 4))) and at most max_connections - 1 (at least 1)\n"
                             "served at once. Every wait of a transfer is bounded by io_timeout_s. Errors inside the service threads are\n"
                             "kept (last 1000) for errors(); those about connections that did not authenticate at\n"
                             "most 10 a minute, the rest counted. Use as a context manager or call stop().\n\n"
                             "spare_dir (relative to base_dir, same file system): a directory of spare files, e.g.\n"
                             "retired replicas. A push takes one (the smallest that holds the object, else the\n"
                             "largest) by renaming it to its temp name, resizes and overwrites it, so the data lands\n"
                             "on tmpfs pages that already exist. Entries that are not plain singly linked files are\n"
                             "ignored; a missing directory means no spares.\n\n"
                             "rank: the rank this server proves in the handshake. policy: a TransferPolicy (None:\n"
                             "any authenticated rank may push any confined path; for transport tests only).\n"
                             "Once data flows a transfer must average min_rate_bytes_per_s after rate_grace_s\n"
                             "(None: io_timeout_s). A push is refused before its data flows when its bytes do not\n"
                             "fit: free space minus what receptions in flight reserved minus space_margin_bytes\n"
                             "(None: 1/32 of the file system), kept free for this node's own saves.")
      .def(py::init([](const py::object& base_dir, const py::bytes& secret, const std::string& host, int port,
                       int max_connections, double io_timeout_s, uint64_t max_object_bytes, int max_pending,
                       const py::object& spare_dir, uint32_t rank, std::shared_ptr<TransferPolicy> policy,
                       double min_rate_bytes_per_s, const py::object& rate_grace_s,
                       const py::object& space_margin_bytes, double handshake_timeout_s, int max_handshakes,
                       int max_connections_per_peer, const py::object& allowed_peers, double request_timeout_s,
                       double queue_timeout_s, int max_queued_per_rank) {
             TransferServerConfig c;
             c.base_dir = fspath(base_dir);
             c.secret = secret;
             c.host = host;
             c.port = port;
             c.max_connections = max_connections;
             c.io_timeout_s = io_timeout_s;
             c.max_object_bytes = max_object_bytes;
             c.max_pending = max_pending;
             c.spare_dir = optional_relative_path(spare_dir);
             c.rank = rank;
             c.policy = std::move(policy);
             c.min_rate_bytes_per_s = min_rate_bytes_per_s;
             if (!rate_grace_s.is_none()) {
               c.rate_grace_s = rate_grace_s.cast<double>();
               if (!(c.rate_grace_s >= 0)) throw std::invalid_argument("rate_grace_s must be >= 0 or None");
             }
             if (!space_margin_bytes.is_none()) {
               c.space_margin_bytes = space_margin_bytes.cast<int64_t>();
               if (c.space_margin_bytes < 0) throw std::invalid_argument("space_margin_bytes must be >= 0 or None");
             }
             c.handshake_timeout_s = handshake_timeout_s;
             c.max_handshakes = max_handshakes;
             c.max_connections_per_peer = max_connections_per_peer;
             c.request_timeout_s = request_timeout_s;
             c.queue_timeout_s = queue_timeout_s;
             c.max_queued_per_rank = max_queued_per_rank;
             std::tie(c.allow_any_peer, c.allowed_peers) = allow_list(allowed_peers);
             py::gil_scoped_release release;
             return std::unique_ptr<TransferServer>(new TransferServer(c));
           }),
           py::arg("base_dir"), py::arg("secret"), py::arg("host") = "127.0.0.1", py::arg("port") = 0,
           py::arg("max_connections") = 4, py::arg("io_timeout_s") = 30.0, py::arg("max_object_bytes") = kDefaultMax,
           py::arg("max_pending") = 0, py::arg("spare_dir") = py::none(), py::kw_only(), py::arg("rank") = 0,
           py::arg("policy") = py::none(), py::arg("min_rate_bytes_per_s") = kTransferDefaultMinRate,
           py::arg("rate_grace_s") = py::none(), py::arg("space_margin_bytes") = py::none(),
           py::arg("handshake_timeout_s") = 5.0, py::arg("max_handshakes") = 64,
           py::arg("max_connections_per_peer") = 32, py::arg("allowed_peers") = py::none(),
           py::arg("request_timeout_s") = 2.0, py::arg("queue_timeout_s") = 10.0,
           py::arg("max_queued_per_rank") = 0)
      .def_property_readonly("port", &TransferServer::port, "The bound TCP port.")
      .def_property_readonly("host", &TransferServer::host)
      .def_property_readonly("running", &TransferServer::running)
      .def_property(
          "allowed_peers", [](const TransferServer& self) { return allow_list_object(self.allowed_peers()); },
          [](TransferServer& self, const py::object& addresses) {
            const auto allowed = allow_list(addresses);
            self.set_allowed_peers(allowed.first, allowed.second);
          },
          "Peer addresses that may connect (canonical numeric text), or None: any. Setting it (None or a list\n"
          "of numeric IPv4/IPv6 addresses; ValueError naming one that is not, nothing changed then) applies to\n"
          "connections accepted from then on.")
      .def(
          "stop",
          [](TransferServer& self) {
            py::gil_scoped_release release;
            self.stop();
          },
          "Close the listener and every connection and join every thread. Idempotent.")
      .def(
          "errors",
          [](TransferServer& self) {
            std::vector<std::string> errors = self.take_errors();
            for (std::string& e : errors) e = printable_text(e);
            return errors;
          },
          "Errors raised inside the service threads since the last call, as strings (then cleared). Bytes\n"
          "outside printable ASCII (peers choose names and messages) appear as \\xNN.")
      .def(
          "expect_sizes",
          [](TransferServer& self, uint64_t step, const std::map<std::string, uint64_t>& sizes) {
            self.expect_sizes(step, sizes);
          },
          py::arg("step"), py::arg("sizes"),
          "Sizes this node's commit record of step gives for objects peers push here ({relative path: bytes}):\n"
          "a push of a listed path must announce exactly its size, a push of an unlisted path into step (with a\n"
          "policy) is refused (TransferForbiddenError on the sender). The newest 8 steps are kept.")
      .def("stats", &TransferServer::stats,
           "Counters: accepted, rejected_not_allowed (address not allowed), rejected_peer_cap (an address at\n"
           "max_connections_per_peer with no handshake to displace), handshakes_dropped (displaced by newer\n"
           "connections), handshake_timeouts, handshakes_ok, handshaking (now), errors_suppressed (by the rate\n"
           "limit), rejected_busy (queue full), rejected_rank_cap (a rank at max_queued_per_rank),\n"
           "request_timeouts (no whole request within request_timeout_s), queue_timeouts (queued past\n"
           "queue_timeout_s), auth_failures, ..., spares_taken (pushes received into a spare file),\n"
           "mappings_reused (of those, written through a mapping kept from an earlier reception), forbidden\n"
           "(requests the policy or the expected sizes refused), no_space (pushes refused for room), too_slow\n"
           "(transfers that fell below the minimum rate).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](TransferServer& self, const py::args&) {
             py::gil_scoped_release release;
             self.stop();
             return false;
           })
      .def("__repr__", [](const TransferServer& self) {
        return "<TransferServer " + self.host() + ":" + std::to_string(self.port()) +
               (self.running() ? ">" : " stopped>");
      });
}

}  // namespace bindings
}  // namespace flashpoint
