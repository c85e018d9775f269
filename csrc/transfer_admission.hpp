// Admission stage of the transfer server: everything between accept() and an authenticated
// connection, so that peers that do not prove a rank of the job never occupy a transfer worker.
//
// One thread (the server's accept thread) accepts, refuses addresses outside the job's
// allow-list before reading or writing a byte, caps the connections per address, and drives the
// server side of every handshake as a non-blocking state machine over its fixed-size messages
// (xfer::ServerHandshake does the cryptography). Each handshake has a budget counted from
// accept(); the number of connections in the stage is capped, and when it is full a new
// connection displaces the oldest connection of the address that holds the most. After the
// client proved its rank (protocol v3, below the job's rank limit), the stage also receives its
// request (bounded: at most kTransferMaxPathBytes of path) within request_timeout_s and checks
// the request's tag before any field of it is used: a connection that authenticates and then
// sends nothing never reaches a worker, and a request a relay altered is answered "integrity"
// from here. Only a connection with an authentic request is handed to the workers, with its
// session, that rank and the request (Admitted), by which the worker's policy decides.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transfer_wire.hpp"

struct sockaddr_storage;

namespace flashpoint {
namespace xfer {

class ErrorLog;

// An IPv4 or IPv6 address as 16 bytes, IPv4 as ::ffff:a.b.c.d (so "10.0.0.5" and
// "::ffff:10.0.0.5" are one peer). The port is not part of it.
struct PeerAddress {
  std::array<uint8_t, 16> bytes{};
  bool operator<(const PeerAddress& o) const { return bytes < o.bytes; }
  bool operator==(const PeerAddress& o) const { return bytes == o.bytes; }
};

// A numeric IPv4 or IPv6 address (an IPv6 zone "%eth0" is ignored); std::invalid_argument
// naming the text otherwise (host names are resolved by the caller).
PeerAddress parse_peer_address(const std::string& text);
// The canonical text of an address ("10.0.0.5", "::1").
std::string address_text(const PeerAddress& address);

struct AdmissionLimits {
  double handshake_timeout_s = 5.0;  // from accept() to a checked client proof
  double request_timeout_s = 2.0;    // from the checked proof to the whole request received
  int max_handshakes = 64;           // connections in the handshake stage at once
  int max_per_peer = 32;             // connections per address, handshaking or served
};

// Counters of the stage, for TransferServer::stats().
struct AdmissionCounters {
  std::atomic<uint64_t> accepted{0}, rejected_not_allowed{0}, rejected_peer_cap{0}, handshakes_dropped{0},
      handshake_timeouts{0}, handshakes_ok{0}, auth_failures{0}, protocol_failures{0}, handshaking{0},
      request_timeouts{0}, integrity_failures{0};
};

// An authenticated connection, handed to a worker: the rank the client proved, the session
// keyed by both ranks and the request whose tag that session checked travel with the socket, so
// the worker authorizes the request by that rank and never waits for it.
struct Admitted {
  int fd = -1;
  PeerAddress address;
  std::string peer;  // "host:port", for messages
  uint32_t rank = 0;  // the client's rank, authenticated by its proof
  std::unique_ptr<Session> session;
  uint8_t request[kRequestBytes] = {};  // the request's fixed fields, authenticated
  std::string path;                     // the request's path, authenticated (not yet checked)
  std::chrono::steady_clock::time_point queued_at;  // set by the server when it joins the queue
};

class Admission {
 public:
  // listen_fd and stop_fd stay owned by the caller; secret and log must outlive this object. The
  // handshakes prove server_rank and admit clients that prove a rank below rank_limit (0: any rank).
  Admission(int listen_fd, int stop_fd, const std::string& secret, uint32_t server_rank, uint32_t rank_limit,
            const AdmissionLimits& limits, ErrorLog& log);
  ~Admission();
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // any: every address may connect; else only those listed. Applies to connections accepted from now on.
  void set_allowed(bool any, const std::vector<PeerAddress>& addresses);
  // (any, the listed addresses as text).
  std::pair<bool, std::vector<std::string>> allowed() const;

  // The admission thread: runs until stop_fd is readable, then closes the connections still in the
  // stage. hand_over takes an authenticated connection (fd and session move to it) and returns
  // false when it cannot (the stage then closes it). every_second runs at least once a second.
  void run(const std::function<bool(Admitted&)>& hand_over, const std::function<void()>& every_second);
  // A handed-over connection from this address was closed: frees its place in the per-address cap.
  void release(const PeerAddress& address);

  const AdmissionCounters& counters() const { return counters_; }

 private:
  struct Handshake;
  using Handshakes = std::list<Handshake>;
  struct Use {
    int open = 0;         // connections from the address: handshaking, queued or served
    int handshaking = 0;  // of those, in this stage
  };

  // Accepts up to a batch; false when accept() ran out of descriptors or memory (pause a while).
  bool accept_some(int epoll_fd, std::chrono::steady_clock::time_point now);
  void admit(int epoll_fd, int fd, const sockaddr_storage& peer, std::chrono::steady_clock::time_point now);
  bool is_allowed(const PeerAddress& address) const;
  void progress(int epoll_fd, Handshakes::iterator it, const std::function<bool(Admitted&)>& hand_over);
  // Receives what of the request is there; true once it is whole and its tag checked out.
  bool receive_request(Handshakes::iterator it);
  // Answers an authenticated connection "integrity" (best effort), then drains it briefly before the close.
  void refuse_integrity(int epoll_fd, Handshakes::iterator it, const std::string& why);
  void timed_out(int epoll_fd, Handshakes::iterator it);
  void set_deadline(Handshake& h, std::chrono::steady_clock::time_point deadline);
  void drop(Handshakes::iterator it, const std::string& why);  // closes, releases, forgets
  void forget(Handshakes::iterator it);                        // as drop, without a word in the log
  Handshakes::iterator victim_for_room();
  Handshakes::iterator oldest_of(const PeerAddress& address);
  void unuse(const PeerAddress& address, bool was_handshaking);

  const int listen_fd_;
  const int stop_fd_;
  const std::string& secret_;
  const uint32_t server_rank_;
  const uint32_t rank_limit_;
  const AdmissionLimits limits_;
  ErrorLog& log_;
  AdmissionCounters counters_;

  mutable std::mutex allow_mutex_;
  bool allow_any_ = true;
  std::vector<PeerAddress> allowed_;  // sorted

  std::mutex use_mutex_;  // the admission thread and the workers (release)
  std::map<PeerAddress, Use> use_;

  // Admission thread only: the stage in accept order, by id, and by deadline.
  Handshakes handshakes_;
  std::unordered_map<uint64_t, Handshakes::iterator> by_id_;
  std::multimap<std::chrono::steady_clock::time_point, uint64_t> deadlines_;
  uint64_t next_id_ = 2;  // 0: the listener, 1: stop_fd
};

}  // namespace xfer
}  // namespace flashpoint
