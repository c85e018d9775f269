// TCP transfer service for checkpoint objects: the transport layer of replication.
//
// A TransferServer serves one base directory (a job's RAM checkpoint root on tmpfs). Peers
// authenticate each other as ranks of the job (HMAC-SHA256 over fresh nonces from both sides,
// keyed per rank from a job-scoped secret), then PUSH an object to the server or FETCH one
// from it. Objects are addressed by their path relative to the base directory; a server with a
// TransferPolicy lets each rank push and fetch only what the replication placement and the
// checkpoint layout allow (transfer_policy.hpp). Both ends confine every path to their own base
// directory (component-wise openat with O_NOFOLLOW). The receiver writes into a hidden
// temporary file next to the destination (a spare file renamed there when a spare directory
// holds one, so its tmpfs pages are reused), checks length and CRC32C, fsyncs and only then
// renames it into place. The wire format is described in docs/protocol.md; every length field
// is bounded and every wait has a timeout. Connections are admitted by one thread that checks the
// peer's address, runs the handshake and receives the request with its tag checked
// (transfer_admission.hpp); only authentic requests reach the worker threads, within caps per
// rank and a deadline in the queue (docs/security.md, "Availability").
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace flashpoint {

class WarmMappingCache;  // transfer_warm.hpp: mappings of received files, reused by later receptions
class SpaceLedger;       // transfer_space.hpp: space reserved by receptions in flight
class TransferPolicy;    // transfer_policy.hpp: who may push and fetch what
class ExpectedSizes;     // transfer_policy.hpp: object sizes from this node's commit records
namespace xfer {
class Channel;    // transfer_wire.hpp: one connection with bounded waits
class Admission;  // transfer_admission.hpp: accept, allow-list, per-address cap, handshakes
struct Admitted;  // an authenticated connection handed to a worker
class ErrorLog;   // transfer_error_log.hpp: the bounded, rate-limited errors()
}

// --- errors (the bindings map each to a Python exception class of the same name) ----------

// A transfer failed (after the last retry, for client operations). Python: TransferError(OSError).
class TransferError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The peer did not prove knowledge of the job secret (or we were refused). Never retried.
class TransferAuthError : public TransferError {
 public:
  using TransferError::TransferError;
};
// A wait for the peer ran past its timeout (connect, send or receive). Python: also TimeoutError.
class TransferTimeoutError : public TransferError {
 public:
  using TransferError::TransferError;
};
// The bytes received do not match the sender's length or CRC32C; nothing was renamed into place.
class TransferChecksumError : public TransferError {
 public:
  using TransferError::TransferError;
};
// An authenticated message (request, response, data chunk, trailer) failed its tag check: the
// connection was tampered with or corrupted; nothing was stored. Never retried.
class TransferIntegrityError : public TransferError {
 public:
  using TransferError::TransferError;
};
// The peer answered and refused the request (too large, I/O error on its side...). Never retried.
class TransferRefusedError : public TransferError {
 public:
  using TransferError::TransferError;
};
// The requested object does not exist on the serving peer. Python: also FileNotFoundError-free
// (subclass of TransferRefusedError only).
class TransferNotFoundError : public TransferRefusedError {
 public:
  using TransferRefusedError::TransferRefusedError;
};
// The serving peer's policy does not let this rank push or fetch that path (not the objects the
// replication placement sends there, not a name of the checkpoint layout, ...). Never retried.
// Python: also PermissionError.
class TransferForbiddenError : public TransferRefusedError {
 public:
  using TransferRefusedError::TransferRefusedError;
};
// The receiver has no room for the object: its free space minus what receptions in flight
// reserved and the margin it keeps for its own saves is smaller. Nothing was stored.
class TransferNoSpaceError : public TransferRefusedError {
 public:
  using TransferRefusedError::TransferRefusedError;
};
// A relative object path was refused (absolute, '..', empty component, NUL, too long, or it
// resolves through a symlink / non-directory). Python: also ValueError.
class TransferPathError : public TransferRefusedError {
 public:
  using TransferRefusedError::TransferRefusedError;
};

// --- limits -------------------------------------------------------------------------------

constexpr size_t kTransferMaxPathBytes = 4096;
constexpr uint64_t kTransferDefaultMaxObjectBytes = uint64_t(64) << 30;  // 64 GiB
constexpr size_t kTransferMinSecretBytes = 16;
constexpr double kTransferDefaultMinRate = 1024.0 * 1024.0;  // bytes/s a transfer keeps up after its grace

// Checks a relative object path and returns its components; throws TransferPathError naming it.
std::vector<std::string> split_relative_path(const std::string& path);

// --- client -------------------------------------------------------------------------------

struct TransferOptions {
  double connect_timeout_s = 5.0;   // non-blocking connect + poll
  double io_timeout_s = 30.0;       // the handshake as a whole, then every wait for progress
  int retries = 3;                  // extra attempts after the first, for retryable failures
  double backoff_s = 0.2;           // sleep before retry i is backoff_s * 2**i
  bool zero_copy = false;           // sendfile() from the source file (else send from the buffer read for the tag)
  uint64_t max_object_bytes = kTransferDefaultMaxObjectBytes;  // fetch refuses bigger objects
  // Push: the CRC32C of the bytes being sent is known (from the object's index), so the sender
  // only sendfile()s them and sends this CRC; the receiver still checks the bytes against it.
  bool has_known_crc = false;
  uint32_t known_crc = 0;
  std::string spare_dir;  // fetch: spare files to receive into, relative to the local base dir
  // Fetch: bytes the reception must leave free on the local file system for this node's own saves
  // (as the server's space_margin_bytes); negative: 1/32 of the file system. TransferNoSpaceError
  // before the data flows when the object does not fit.
  int64_t space_margin_bytes = -1;
  uint32_t rank = 0;       // the rank this side proves in the handshake
  uint32_t peer_rank = 0;  // the rank the server must prove (the one the caller means to reach)
  // Once the data flows, the transfer must average at least min_rate_bytes_per_s after its
  // first rate_grace_s seconds (negative: io_timeout_s), else TransferTimeoutError. 0: no floor.
  double min_rate_bytes_per_s = kTransferDefaultMinRate;
  double rate_grace_s = -1;
};

struct TransferResult {
  uint64_t nbytes = 0;
  uint32_t crc32c = 0;
  int attempts = 0;
  double seconds = 0;
};

// Pushes local_base_dir/path to the server as remote_path (path when empty).
TransferResult transfer_push_path(const std::string& host, int port, const std::string& secret,
                                  const std::string& local_base_dir, const std::string& path,
                                  const std::string& remote_path, const TransferOptions& options);
// Pushes bytes [offset, offset+length) of an open file as remote_path.
TransferResult transfer_push_fd(const std::string& host, int port, const std::string& secret, int fd,
                                uint64_t offset, uint64_t length, const std::string& remote_path,
                                const TransferOptions& options);
// Fetches remote_path from the server into local_base_dir/local_path (remote_path when empty).
TransferResult transfer_fetch(const std::string& host, int port, const std::string& secret,
                              const std::string& remote_path, const std::string& local_base_dir,
                              const std::string& local_path, const TransferOptions& options);

// --- server -------------------------------------------------------------------------------

struct TransferServerConfig {
  std::string base_dir;
  std::string secret;
  std::string host = "127.0.0.1";
  int port = 0;
  int max_connections = 4;       // worker threads; authenticated requests beyond them wait in a bounded queue
  int max_pending = 0;           // queued requests beyond the workers (0: 4 * max_connections)
  double io_timeout_s = 30.0;
  // Admission (transfer_admission.hpp): handshakes and requests are received in the accept
  // thread, never on a worker.
  double handshake_timeout_s = 5.0;   // from accept() to the client's proof checked
  double request_timeout_s = 2.0;     // from the proof checked to the whole request received
  int max_handshakes = 64;            // connections in the admission stage at once
  int max_connections_per_peer = 32;  // per peer address, in the stage, queued or served
  // Per authenticated rank: requests waiting in the queue at once (more are closed unserved);
  // besides, at most max_connections - 1 (at least 1) of a rank's requests are served at once, so
  // one rank never holds every worker nor the queue. 0: max(1, min(4, max_pending / 4)).
  int max_queued_per_rank = 0;
  double queue_timeout_s = 10.0;  // a request queued longer is closed unserved (its client retries)
  // Peer addresses allowed to connect (numeric IPv4/IPv6); others are closed at accept(), before
  // a byte is read or written. allow_any_peer: every address (the list is ignored).
  bool allow_any_peer = true;
  std::vector<std::string> allowed_peers;
  uint64_t max_object_bytes = kTransferDefaultMaxObjectBytes;
  // Directory (relative to base_dir) of spare files: retired replicas whose tmpfs pages a push
  // overwrites instead of allocating fresh ones. Empty: none. Missing: none for now.
  std::string spare_dir;
  uint32_t rank = 0;  // the rank this server proves in the handshake
  // Who may push and fetch what; null: any authenticated rank any confined path (transport
  // tests and benchmarks only: the replication service always gives one).
  std::shared_ptr<const TransferPolicy> policy;
  double min_rate_bytes_per_s = kTransferDefaultMinRate;  // as TransferOptions
  double rate_grace_s = -1;                              // negative: io_timeout_s
  // Bytes a reception must leave free for this node's own saves; negative: 1/32 of the file system.
  int64_t space_margin_bytes = -1;
};

class TransferServer {
 public:
  explicit TransferServer(const TransferServerConfig& config);
  ~TransferServer();
  TransferServer(const TransferServer&) = delete;
  TransferServer& operator=(const TransferServer&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return config_.host; }
  bool running() const { return !stopped_.load(); }
  // Closes the listener and every connection, joins every thread. Idempotent.
  void stop();
  // Errors raised in the service threads since the last call (oldest first), then cleared.
  // Errors about connections that did not authenticate are rate-limited (transfer_error_log.hpp).
  std::vector<std::string> take_errors();
  std::map<std::string, uint64_t> stats() const;
  // Object sizes this node's commit record of step lists (relative path -> bytes): a push of one
  // of them must announce exactly that size, and a push into step of another path is refused.
  void expect_sizes(uint64_t step, std::map<std::string, uint64_t> sizes);
  // Replaces the allow-list for connections accepted from now on (std::invalid_argument naming an
  // address that is not numeric; nothing changes then). any: every address may connect.
  void set_allowed_peers(bool any, const std::vector<std::string>& addresses);
  // (any, the allowed addresses in canonical text).
  std::pair<bool, std::vector<std::string>> allowed_peers() const;

 private:
  void worker_loop();
  // One authenticated connection being served: its channel, socket, peer, "push of 'path'" and
  // the rank the peer proved.
  struct Connection {
    xfer::Channel& ch;
    int fd;
    const std::string& peer;
    std::string what;
    uint32_t rank;
  };
  void handle(int fd, xfer::Admitted& admitted);
  void handle_push(const Connection& c, const std::string& path, uint64_t size);
  void handle_fetch(const Connection& c, const std::string& path);
  void refuse(const Connection& c, uint32_t status, const std::string& message);
  void record_error(const std::string& message);
  bool hand_over(xfer::Admitted& admitted);
  // Under queue_mutex_: moves the queued requests older than queue_timeout_s to expired.
  void take_expired(std::vector<std::unique_ptr<xfer::Admitted>>* expired);
  // Under queue_mutex_: the oldest queued request whose rank may take another worker, or null.
  std::unique_ptr<xfer::Admitted> next_request();
  void close_expired(std::vector<std::unique_ptr<xfer::Admitted>>& expired);
  void start_rate_floor(xfer::Channel& ch) const;

  TransferServerConfig config_;
  int base_fd_ = -1;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd, readable once stop() began: wakes every poll()
  int port_ = 0;
  std::atomic<bool> stopped_{false};
  std::mutex stop_mutex_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::unique_ptr<xfer::Admitted>> queue_;
  std::map<uint32_t, int> rank_queued_;   // per rank: requests in the queue
  std::map<uint32_t, int> rank_served_;   // per rank: requests being served
  int max_served_per_rank_ = 1;
  bool stopping_ = false;

  std::unique_ptr<xfer::ErrorLog> errors_;
  std::unique_ptr<xfer::Admission> admission_;
  std::thread accept_thread_;  // runs admission_
  std::vector<std::thread> workers_;
  std::unique_ptr<WarmMappingCache> mappings_;
  std::unique_ptr<SpaceLedger> space_;
  std::unique_ptr<ExpectedSizes> expected_;

  std::atomic<uint64_t> rejected_busy_{0}, rejected_rank_cap_{0}, queue_timeouts_{0}, protocol_failures_{0}, integrity_failures_{0},
      pushes_ok_{0}, fetches_ok_{0}, transfer_failures_{0}, bytes_received_{0}, bytes_sent_{0}, spares_taken_{0},
      mappings_reused_{0}, temp_files_swept_{0}, forbidden_{0}, no_space_{0}, too_slow_{0};
};

}  // namespace flashpoint
