// Wire layer of the transfer service: framing, bounded socket I/O and the handshake.
// The byte layout is described in docs/protocol.md; this file and transfer_wire.cpp own it.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>

#include "errors.hpp"
#include "crypto.hpp"
#include "transfer.hpp"
#include "transfer_mac.hpp"

namespace flashpoint {
namespace xfer {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'M', 'L', 'F', 'P', 'X', 'F', 'R', '\0'};
constexpr uint32_t kProtocolVersion = 3;  // 2: everything after the handshake authenticated; 3: per-rank keys, GMAC tags
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kClientHelloBytes = 8 + 4 + 4 + kNonceBytes;
constexpr size_t kServerHelloBytes = 8 + 4 + 4 + kNonceBytes + kMacBytes;
constexpr size_t kRequestBytes = 24;
constexpr size_t kResponseBytes = 16;
constexpr size_t kTrailerBytes = 16;
constexpr uint32_t kTrailerMagic = 0x21444E45;  // "END!"
constexpr size_t kMaxMessageBytes = 4096;
constexpr const char kRankKeyLabel[] = "mlfp-xfer-v3 rank";
constexpr const char kServerLabel[] = "mlfp-xfer-v3 server";
constexpr const char kClientLabel[] = "mlfp-xfer-v3 client";
constexpr const char kSessionLabel[] = "mlfp-xfer-v3 session";

enum Op : uint32_t { kOpPush = 1, kOpFetch = 2 };
enum Status : uint32_t {
  kOk = 0,
  kBadRequest = 1,
  kPathRefused = 2,
  kTooLarge = 3,
  kNotFound = 4,
  kChecksum = 5,
  kIoError = 6,
  kIntegrity = 7,  // a message failed its tag check
  kForbidden = 8,  // the policy does not let this rank push or fetch that path
  kNoSpace = 9,    // the receiver has no room for the object
};
constexpr uint32_t kLastStatus = kNoSpace;

const char* status_name(uint32_t s);

inline void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
inline void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
inline uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
inline uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// Peer-chosen text for messages: quoted, control bytes escaped, at most 200 bytes shown.
std::string quoted(const std::string& s);
inline std::string errno_text(int err) { return std::strerror(err); }
// n random bytes (libcrypto, crypto.hpp) as 2n hex digits.
std::string random_hex(size_t bytes);

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

inline int timeout_ms(double seconds) {
  if (!(seconds > 0)) return 0;
  const double ms = std::ceil(seconds * 1000.0);
  return ms > 2e9 ? 2000000000 : static_cast<int>(ms);
}

// Blocks SIGPIPE around a sendfile() (which has no MSG_NOSIGNAL) and swallows a SIGPIPE it raised.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_set_);
    sigaddset(&pipe_set_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_set_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const struct timespec zero {0, 0};
        while (sigtimedwait(&pipe_set_, nullptr, &zero) < 0 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_set_, old_;
  bool was_pending_ = false;
};

// One non-blocking TCP connection with bounded waits. stop_fd (or -1) aborts every wait.
class Channel {
 public:
  Channel(int fd, double io_timeout_s, int stop_fd) : fd_(fd), io_timeout_s_(io_timeout_s), stop_fd_(stop_fd) {}

  // Until clear_deadline(), waits also end at now + seconds (the handshake budget).
  void set_deadline(double seconds) {
    deadline_ = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
    has_deadline_ = true;
  }
  void clear_deadline() { has_deadline_ = false; }

  // From now on the bytes moved (both directions) must average bytes_per_s from this moment,
  // after a grace of grace_s: a wait also ends when they fall behind that (0: no floor).
  void start_rate_floor(double bytes_per_s, double grace_s) {
    floor_rate_ = bytes_per_s > 0 ? bytes_per_s : 0;
    floor_grace_s_ = grace_s;
    floor_start_ = Clock::now();
    floor_moved_start_ = moved_;
  }
  // True once a wait ended because the transfer fell below its minimum rate.
  bool fell_below_rate() const { return fell_below_rate_; }

  // The authenticated session the handshake established; every message after it uses it.
  void start_session(std::unique_ptr<Session> s) { session_ = std::move(s); }
  Session& session() {
    if (!session_) throw std::logic_error("transfer channel used before its handshake");
    return *session_;
  }

  void recv_exact(void* buf, size_t n, const char* what) {
    uint8_t* p = static_cast<uint8_t*>(buf);
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::recv(fd_, p + got, n - got, 0);
      if (r > 0) {
        got += static_cast<size_t>(r);
        moved_ += static_cast<uint64_t>(r);
      } else if (r == 0) {
        throw TransferError("connection closed by the peer after " + std::to_string(got) + " of " +
                            std::to_string(n) + " bytes of " + what);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLIN, what);
      } else if (errno != EINTR) {
        throw TransferError(std::string("receiving ") + what + " failed: " + errno_text(errno));
      }
    }
  }

  // While bulk data arrives: poll reports input only once `bytes` are queued (SO_RCVLOWAT), so that a receiver
  // faster than its peer is woken once per that many bytes, not once per TCP segment. The caller keeps it at
  // most what the peer must still send; 1 restores the default. Waits under a mark still wake every
  // kLowWaterSliceMs to read whatever is queued (wait()), so timeouts and the rate floor judge a slow peer as
  // before, and a kernel that cannot queue the mark costs speed, never a stall.
  void set_receive_low_water(int bytes) {
    if (bytes == receive_low_water_) return;
    // Refused: the kernel keeps the last mark, and so does receive_low_water_ (waits stay sliced while it is > 1).
    if (::setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof(bytes)) != 0) return;
    receive_low_water_ = bytes;
    if (bytes == 1) return;
    // Linux >= 4.18 enlarges the receive buffer to hold the mark; where it does not (older kernels, a locked
    // SO_RCVBUF) the window could close before the mark is queued: keep it within a quarter of the buffer.
    int rcvbuf = 0;
    socklen_t len = sizeof(rcvbuf);
    if (::getsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len) == 0 && rcvbuf / 2 < bytes) {
      const int lower = std::max(1, rcvbuf / 4);
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &lower, sizeof(lower));
    }
  }

  // Receives 1..n bytes.
  size_t recv_some(void* buf, size_t n, const char* what) {
    for (;;) {
      const ssize_t r = ::recv(fd_, buf, n, 0);
      if (r > 0) {
        moved_ += static_cast<uint64_t>(r);
        return static_cast<size_t>(r);
      }
      if (r == 0) throw TransferError(std::string("connection closed by the peer during ") + what);
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLIN, what);
      } else if (errno != EINTR) {
        throw TransferError(std::string("receiving ") + what + " failed: " + errno_text(errno));
      }
    }
  }

  // Receives 1..na + nb bytes with one call: first into a, then (only once a is full) into b.
  // Returns the bytes that went into a; *b_got says how many went into b. The receiver of an
  // object reads the end of a chunk and its tag this way.
  size_t recv_some_then(void* a, size_t na, void* b, size_t nb, size_t* b_got, const char* what) {
    struct iovec iov[2] = {{a, na}, {b, nb}};
    struct msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    for (;;) {
      const ssize_t r = ::recvmsg(fd_, &msg, 0);
      if (r > 0) {
        moved_ += static_cast<uint64_t>(r);
        const size_t got = static_cast<size_t>(r);
        *b_got = got > na ? got - na : 0;
        return got - *b_got;
      }
      if (r == 0) throw TransferError(std::string("connection closed by the peer during ") + what);
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLIN, what);
      } else if (errno != EINTR) {
        throw TransferError(std::string("receiving ") + what + " failed: " + errno_text(errno));
      }
    }
  }

  // flags are added to MSG_NOSIGNAL (MSG_MORE: more follows at once, do not push a short segment).
  void send_all(const void* buf, size_t n, const char* what, int flags = 0) {
    const uint8_t* p = static_cast<const uint8_t*>(buf);
    size_t sent = 0;
    while (sent < n) {
      const ssize_t r = ::send(fd_, p + sent, n - sent, MSG_NOSIGNAL | flags);
      if (r >= 0) {
        sent += static_cast<size_t>(r);
        moved_ += static_cast<uint64_t>(r);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLOUT, what);
      } else if (errno != EINTR) {
        throw TransferError(std::string("sending ") + what + " failed: " + errno_text(errno));
      }
    }
  }

  // sendfile() of [offset, offset+n); returns false (nothing sent) when the kernel cannot
  // sendfile from this file, so the caller falls back to send(). sendfile has no MSG_NOSIGNAL:
  // the caller blocks SIGPIPE around all its sendfile calls with one SigpipeGuard.
  bool sendfile_all(int file_fd, uint64_t offset, uint64_t n, const SigpipeGuard& /*sigpipe_blocked*/) {
    off_t off = static_cast<off_t>(offset);
    uint64_t sent = 0;
    while (sent < n) {
      const ssize_t r = ::sendfile(fd_, file_fd, &off, static_cast<size_t>(n - sent));
      if (r > 0) {
        sent += static_cast<uint64_t>(r);
        moved_ += static_cast<uint64_t>(r);
      } else if (r == 0) {
        throw ShortReadError("source file ended before the " + std::to_string(offset + n) +
                             " bytes being sent (was it truncated?)");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLOUT, "object data");
      } else if ((errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) && sent == 0) {
        return false;
      } else if (errno != EINTR) {
        throw TransferError(std::string("sending object data failed: ") + errno_text(errno));
      }
    }
    return true;
  }

 private:
  enum Limit { kIoTimeout, kHandshakeBudget, kRateFloor };

  // Under a receive low-water mark a wait for input wakes this often to read what fewer bytes are queued.
  static constexpr int kLowWaterSliceMs = 50;

  void wait(short events, const char* what) {
    const auto started = Clock::now();  // the io timeout counts from here (in double: it may be huge)
    const bool sliced = (events & POLLIN) && receive_low_water_ > 1;
    for (;;) {
      const auto now = Clock::now();
      double budget = io_timeout_s_ - std::chrono::duration<double>(now - started).count();
      Limit limit = kIoTimeout;
      if (has_deadline_) {
        const double left = std::chrono::duration<double>(deadline_ - now).count();
        if (left < budget) {
          budget = left;
          limit = kHandshakeBudget;
        }
      }
      if (floor_rate_ > 0) {  // behind once now > start + grace + moved / rate
        const double due = floor_grace_s_ + double(moved_ - floor_moved_start_) / floor_rate_;
        const double left = due - std::chrono::duration<double>(now - floor_start_).count();
        if (left < budget) {
          budget = left;
          limit = kRateFloor;
        }
      }
      if (budget <= 0) throw_timeout(what, limit);
      struct pollfd fds[2] = {{fd_, events, 0}, {stop_fd_, POLLIN, 0}};
      const int ms = sliced ? std::min(timeout_ms(budget), kLowWaterSliceMs) : timeout_ms(budget);
      const int r = ::poll(fds, stop_fd_ >= 0 ? 2 : 1, ms);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw OsError(errno, "poll failed", "");
      }
      if (stop_fd_ >= 0 && (fds[1].revents & POLLIN)) throw TransferError("server is stopping");
      if (r == 0) {
        int queued = 0;
        if (sliced && ::ioctl(fd_, FIONREAD, &queued) == 0 && queued > 0) return;  // below the mark: read it
        if (sliced) continue;  // the budget above decides
        throw_timeout(what, limit);
      }
      return;  // ready, or an error condition the next syscall reports
    }
  }

  [[noreturn]] void throw_timeout(const char* what, Limit limit) {
    char text[200];
    if (limit == kRateFloor) {
      fell_below_rate_ = true;
      const double elapsed = std::chrono::duration<double>(Clock::now() - floor_start_).count();
      std::snprintf(text, sizeof(text), "%llu bytes in %.3g s, below the minimum of %.0f bytes/s after %.3g s",
                    static_cast<unsigned long long>(moved_ - floor_moved_start_), elapsed, floor_rate_,
                    floor_grace_s_);
      throw TransferTimeoutError(std::string("the transfer fell below its minimum rate (") + what + ": " + text + ")");
    }
    std::snprintf(text, sizeof(text), "%.3g", io_timeout_s_);
    throw TransferTimeoutError(std::string("timed out waiting for the peer (") + what + ", " +
                               (limit == kHandshakeBudget ? "handshake budget " : "io timeout ") + text + " s)");
  }

  int fd_;
  double io_timeout_s_;
  int stop_fd_;
  bool has_deadline_ = false;
  Clock::time_point deadline_;
  uint64_t moved_ = 0;  // bytes sent and received on this connection
  double floor_rate_ = 0, floor_grace_s_ = 0;
  Clock::time_point floor_start_;
  uint64_t floor_moved_start_ = 0;
  bool fell_below_rate_ = false;
  int receive_low_water_ = 1;  // SO_RCVLOWAT as last set, or less (capped below); 1: the default
  std::unique_ptr<Session> session_;
};

inline void set_socket_options(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The key that proves a rank: HMAC-SHA256(secret, "mlfp-xfer-v3 rank" || u32 rank).
Digest256 rank_key(const std::string& secret, uint32_t rank);

// Client: authenticates both ends as ranks of the job (TransferAuthError when a side fails):
// proves client_rank, checks that the server proves server_rank, and starts the channel's
// session (keys derived from both ranks' keys and both nonces). The server's side is
// ServerHandshake, driven by the admission stage (transfer_admission.hpp).
void client_handshake(Channel& ch, const std::string& secret, uint32_t client_rank, uint32_t server_rank);

// A client hello of another protocol version: the reply given to answer() tells the client ours
// (rank, nonce and MAC zero); send it, then close.
class VersionMismatchError : public TransferError {
 public:
  using TransferError::TransferError;
};

// The server's side of the handshake in two steps over its fixed-size messages, for a caller that
// moves the bytes itself (the admission stage's non-blocking state machine, transfer_admission.cpp).
class ServerHandshake {
 public:
  // Takes the client hello (kClientHelloBytes, naming the rank the client claims) and writes the
  // server hello (kServerHelloBytes, proving server_rank) into reply. Throws TransferError when
  // the hello is not a flashpoint client hello (bad magic) and VersionMismatchError (reply
  // filled, see there) for another version.
  void answer(const std::string& secret, uint32_t server_rank, const uint8_t* hello, uint8_t* reply);
  // Checks the client proof (kMacBytes) in constant time: TransferAuthError when the client does
  // not prove the rank it claimed, or that rank is not below rank_limit (0: no limit). Returns the
  // session of the connection (keys derived from both ranks' keys and both nonces); client_rank()
  // is then the authenticated rank of the peer.
  std::unique_ptr<Session> finish(const std::string& secret, uint32_t rank_limit, const uint8_t* proof) const;
  // The rank the hello claimed; authenticated once finish() returned.
  uint32_t client_rank() const { return client_rank_; }

 private:
  uint32_t client_rank_ = 0;
  uint32_t server_rank_ = 0;
  uint8_t nonce_c_[kNonceBytes] = {};
  uint8_t nonce_s_[kNonceBytes] = {};
};

struct Response {
  uint32_t status = kOk;
  uint64_t value = 0;
  std::string message;
};

void send_request(Channel& ch, uint32_t op, const std::string& path, uint64_t size);
void send_response(Channel& ch, uint32_t status, uint64_t value, const std::string& message);
Response recv_response(Channel& ch);
void send_trailer(Channel& ch, uint64_t nbytes, uint32_t crc);
// Receives a message's tag and checks it (TransferIntegrityError naming what).
void recv_tag(Channel& ch, KeyedMac& mac, const char* what);
// Sends the message's tag; flags as for Channel::send_all (MSG_MORE after a data chunk).
void send_tag(Channel& ch, KeyedMac& mac, const char* what, int flags = 0);
// Checks the trailer that follows the data against the length and CRC32C received.
void check_trailer(Channel& ch, uint64_t size, uint32_t crc);

}  // namespace xfer
}  // namespace flashpoint
