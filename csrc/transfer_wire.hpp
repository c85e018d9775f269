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
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>

#include "errors.hpp"
#include "sha256.hpp"
#include "transfer.hpp"
#include "transfer_mac.hpp"

namespace flashpoint {
namespace xfer {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'M', 'L', 'F', 'P', 'X', 'F', 'R', '\0'};
constexpr uint32_t kProtocolVersion = 2;  // 2: everything after the handshake is authenticated
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kClientHelloBytes = 8 + 4 + 4 + kNonceBytes;
constexpr size_t kServerHelloBytes = 8 + 4 + 4 + kNonceBytes + kMacBytes;
constexpr size_t kRequestBytes = 24;
constexpr size_t kResponseBytes = 16;
constexpr size_t kTrailerBytes = 16;
constexpr uint32_t kTrailerMagic = 0x21444E45;  // "END!"
constexpr size_t kMaxMessageBytes = 4096;
constexpr const char kServerLabel[] = "mlfp-xfer-v2 server";
constexpr const char kClientLabel[] = "mlfp-xfer-v2 client";

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
};

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
void fill_random(void* buf, size_t n);
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

  // Receives 1..n bytes.
  size_t recv_some(void* buf, size_t n, const char* what) {
    for (;;) {
      const ssize_t r = ::recv(fd_, buf, n, 0);
      if (r > 0) return static_cast<size_t>(r);
      if (r == 0) throw TransferError(std::string("connection closed by the peer during ") + what);
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLIN, what);
      } else if (errno != EINTR) {
        throw TransferError(std::string("receiving ") + what + " failed: " + errno_text(errno));
      }
    }
  }

  void send_all(const void* buf, size_t n, const char* what) {
    const uint8_t* p = static_cast<const uint8_t*>(buf);
    size_t sent = 0;
    while (sent < n) {
      const ssize_t r = ::send(fd_, p + sent, n - sent, MSG_NOSIGNAL);
      if (r >= 0) {
        sent += static_cast<size_t>(r);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait(POLLOUT, what);
      } else if (errno != EINTR) {
        throw TransferError(std::string("sending ") + what + " failed: " + errno_text(errno));
      }
    }
  }

  // sendfile() of [offset, offset+n); returns false (nothing sent) when the kernel cannot
  // sendfile from this file, so the caller falls back to send().
  bool sendfile_all(int file_fd, uint64_t offset, uint64_t n) {
    SigpipeGuard guard;
    off_t off = static_cast<off_t>(offset);
    uint64_t sent = 0;
    while (sent < n) {
      const ssize_t r = ::sendfile(fd_, file_fd, &off, static_cast<size_t>(n - sent));
      if (r > 0) {
        sent += static_cast<uint64_t>(r);
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
  void wait(short events, const char* what) {
    for (;;) {
      double budget = io_timeout_s_;
      if (has_deadline_) {
        const double left = std::chrono::duration<double>(deadline_ - Clock::now()).count();
        budget = std::min(budget, left);
      }
      if (budget <= 0) throw_timeout(what);
      struct pollfd fds[2] = {{fd_, events, 0}, {stop_fd_, POLLIN, 0}};
      const int r = ::poll(fds, stop_fd_ >= 0 ? 2 : 1, timeout_ms(budget));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw OsError(errno, "poll failed", "");
      }
      if (stop_fd_ >= 0 && (fds[1].revents & POLLIN)) throw TransferError("server is stopping");
      if (r == 0) {
        if (has_deadline_ && Clock::now() >= deadline_) throw_timeout(what);
        throw_timeout(what);
      }
      return;  // ready, or an error condition the next syscall reports
    }
  }

  [[noreturn]] void throw_timeout(const char* what) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.3g", io_timeout_s_);
    throw TransferTimeoutError(std::string("timed out waiting for the peer (") + what + ", " +
                               (has_deadline_ ? "handshake budget " : "io timeout ") + secs + " s)");
  }

  int fd_;
  double io_timeout_s_;
  int stop_fd_;
  bool has_deadline_ = false;
  Clock::time_point deadline_;
  std::unique_ptr<Session> session_;
};

inline void set_socket_options(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Authenticates both ends with the job secret (throws TransferAuthError on a wrong one) and
// starts the channel's session (keys derived from the secret and both nonces).
void client_handshake(Channel& ch, const std::string& secret);

// A client hello of another protocol version: the reply given to answer() tells the client ours
// (nonce and MAC zero); send it, then close.
class VersionMismatchError : public TransferError {
 public:
  using TransferError::TransferError;
};

// The server's side of the handshake in two steps over its fixed-size messages, for a caller that
// moves the bytes itself (the admission stage's non-blocking state machine, transfer_admission.cpp).
class ServerHandshake {
 public:
  // Takes the client hello (kClientHelloBytes) and writes the server hello (kServerHelloBytes) into
  // reply. Throws TransferError when the hello is not a flashpoint client hello (bad magic, non-zero
  // reserved field) and VersionMismatchError (reply filled, see there) for another version.
  void answer(const std::string& secret, const uint8_t* hello, uint8_t* reply);
  // Checks the client proof (kMacBytes) in constant time: TransferAuthError on a wrong secret.
  // Returns the session of the connection (keys derived from the secret and both nonces).
  std::unique_ptr<Session> finish(const std::string& secret, const uint8_t* proof) const;

 private:
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
void send_tag(Channel& ch, KeyedMac& mac, const char* what);
// Checks the trailer that follows the data against the length and CRC32C received.
void check_trailer(Channel& ch, uint64_t size, uint32_t crc);

}  // namespace xfer
}  // namespace flashpoint
