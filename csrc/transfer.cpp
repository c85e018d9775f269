// TCP transfer service: see transfer.hpp.
//
// Wire format (protocol version 1; all integers little-endian):
//
//   client -> server  HELLO   magic "MLFPXFR\0" (8) | u32 version=1 | u32 reserved=0 | nonce_c (32)
//   server -> client  HELLO   magic (8) | u32 version=1 | u32 reserved=0 | nonce_s (32)
//                             | HMAC-SHA256(secret, "mlfp-xfer-v1 server" || nonce_c || nonce_s) (32)
//   client -> server  PROOF   HMAC-SHA256(secret, "mlfp-xfer-v1 client" || nonce_c || nonce_s) (32)
//   client -> server  REQUEST u32 op (1=PUSH, 2=FETCH) | u32 path_len (1..4096) | u64 size
//                             | u32 flags=0 | u32 reserved=0 | path (path_len bytes, UTF-8)
//   server -> client  RESPONSE u32 status | u32 msg_len (<= 4096) | u64 value | msg (msg_len bytes)
//
//   PUSH:  REQUEST(size = object bytes) -> RESPONSE(OK: ready) -> DATA (size bytes) + TRAILER
//          -> RESPONSE(OK: renamed into place | CHECKSUM: discarded)
//   FETCH: REQUEST(size = 0) -> RESPONSE(OK, value = object bytes) -> DATA + TRAILER
//          -> RESPONSE from the client (OK | CHECKSUM), so the server can log the outcome
//   TRAILER: u64 nbytes | u32 crc32c of the data | u32 end magic 0x21444E45 ("END!")
//
// Each connection carries one operation. The handshake, request and first response must all
// complete within io_timeout_s of the connection being taken up; after that every wait for
// progress is bounded by io_timeout_s.
#include "transfer.hpp"

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

#include "crc32c.hpp"
#include "errors.hpp"
#include "sha256.hpp"

namespace flashpoint {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'M', 'L', 'F', 'P', 'X', 'F', 'R', '\0'};
constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kClientHelloBytes = 8 + 4 + 4 + kNonceBytes;
constexpr size_t kServerHelloBytes = 8 + 4 + 4 + kNonceBytes + kMacBytes;
constexpr size_t kRequestBytes = 24;
constexpr size_t kResponseBytes = 16;
constexpr size_t kTrailerBytes = 16;
constexpr uint32_t kTrailerMagic = 0x21444E45;  // "END!"
constexpr size_t kMaxMessageBytes = 4096;
constexpr size_t kChunkBytes = size_t(256) << 10;  // one CRC + one write per chunk, stays in L2
constexpr const char kServerLabel[] = "mlfp-xfer-v1 server";
constexpr const char kClientLabel[] = "mlfp-xfer-v1 client";

enum Op : uint32_t { kOpPush = 1, kOpFetch = 2 };
enum Status : uint32_t {
  kOk = 0,
  kBadRequest = 1,
  kPathRefused = 2,
  kTooLarge = 3,
  kNotFound = 4,
  kChecksum = 5,
  kIoError = 6,
};

const char* status_name(uint32_t s) {
  switch (s) {
    case kOk: return "ok";
    case kBadRequest: return "bad request";
    case kPathRefused: return "path refused";
    case kTooLarge: return "too large";
    case kNotFound: return "not found";
    case kChecksum: return "checksum mismatch";
    case kIoError: return "I/O error";
    default: return "unknown status";
  }
}

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (unsigned char c : s.substr(0, 200)) {
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += char(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out + "'";
}

std::string errno_text(int err) { return std::strerror(err); }

void fill_random(void* buf, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    const ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw OsError(errno, "getrandom failed", "");
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
}

std::string random_hex(size_t bytes) {
  std::vector<uint8_t> raw(bytes);
  fill_random(raw.data(), raw.size());
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : raw) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

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

int timeout_ms(double seconds) {
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
};

void set_socket_options(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// --- messages -----------------------------------------------------------------------------

Digest256 handshake_mac(const std::string& secret, const char* label, const uint8_t* nonce_c, const uint8_t* nonce_s) {
  HmacSha256 h(secret.data(), secret.size());
  h.update(label, std::strlen(label));
  h.update(nonce_c, kNonceBytes);
  h.update(nonce_s, kNonceBytes);
  return h.finish();
}

void check_magic_version(const uint8_t* msg, const char* who) {
  if (std::memcmp(msg, kMagic, sizeof(kMagic)) != 0)
    throw TransferError(std::string("bad protocol magic from the ") + who + " (not a flashpoint transfer peer)");
  const uint32_t version = get_u32(msg + 8);
  if (version != kProtocolVersion)
    throw TransferError(std::string("unsupported protocol version ") + std::to_string(version) + " from the " + who +
                        " (this side speaks " + std::to_string(kProtocolVersion) + ")");
  if (get_u32(msg + 12) != 0) throw TransferError(std::string("non-zero reserved field in the ") + who + " hello");
}

void server_handshake(Channel& ch, const std::string& secret) {
  uint8_t hello[kClientHelloBytes];
  ch.recv_exact(hello, sizeof(hello), "client hello");
  check_magic_version(hello, "client");
  const uint8_t* nonce_c = hello + 16;
  uint8_t reply[kServerHelloBytes];
  std::memcpy(reply, kMagic, sizeof(kMagic));
  put_u32(reply + 8, kProtocolVersion);
  put_u32(reply + 12, 0);
  uint8_t* nonce_s = reply + 16;
  fill_random(nonce_s, kNonceBytes);
  const Digest256 server_mac = handshake_mac(secret, kServerLabel, nonce_c, nonce_s);
  std::memcpy(reply + 16 + kNonceBytes, server_mac.data(), kMacBytes);
  ch.send_all(reply, sizeof(reply), "server hello");
  uint8_t proof[kMacBytes];
  ch.recv_exact(proof, sizeof(proof), "client proof");
  const Digest256 expected = handshake_mac(secret, kClientLabel, nonce_c, nonce_s);
  if (!constant_time_equal(proof, expected.data(), kMacBytes))
    throw TransferAuthError("client failed authentication (wrong job secret)");
}

void client_handshake(Channel& ch, const std::string& secret) {
  uint8_t hello[kClientHelloBytes];
  std::memcpy(hello, kMagic, sizeof(kMagic));
  put_u32(hello + 8, kProtocolVersion);
  put_u32(hello + 12, 0);
  uint8_t* nonce_c = hello + 16;
  fill_random(nonce_c, kNonceBytes);
  ch.send_all(hello, sizeof(hello), "client hello");
  uint8_t reply[kServerHelloBytes];
  ch.recv_exact(reply, sizeof(reply), "server hello");
  check_magic_version(reply, "server");
  const uint8_t* nonce_s = reply + 16;
  const Digest256 expected = handshake_mac(secret, kServerLabel, nonce_c, nonce_s);
  if (!constant_time_equal(reply + 16 + kNonceBytes, expected.data(), kMacBytes))
    throw TransferAuthError("server failed authentication (wrong job secret on one side, or not the expected peer)");
  const Digest256 proof = handshake_mac(secret, kClientLabel, nonce_c, nonce_s);
  ch.send_all(proof.data(), proof.size(), "client proof");
}

struct Response {
  uint32_t status = kOk;
  uint64_t value = 0;
  std::string message;
};

void send_response(Channel& ch, uint32_t status, uint64_t value, const std::string& message) {
  const std::string msg = message.substr(0, kMaxMessageBytes);
  std::vector<uint8_t> buf(kResponseBytes + msg.size());
  put_u32(buf.data(), status);
  put_u32(buf.data() + 4, static_cast<uint32_t>(msg.size()));
  put_u64(buf.data() + 8, value);
  std::memcpy(buf.data() + kResponseBytes, msg.data(), msg.size());
  ch.send_all(buf.data(), buf.size(), "response");
}

Response recv_response(Channel& ch) {
  uint8_t head[kResponseBytes];
  ch.recv_exact(head, sizeof(head), "response");
  Response r;
  r.status = get_u32(head);
  const uint32_t len = get_u32(head + 4);
  r.value = get_u64(head + 8);
  if (len > kMaxMessageBytes) throw TransferError("malformed response: message length " + std::to_string(len));
  if (r.status > kIoError) throw TransferError("malformed response: unknown status " + std::to_string(r.status));
  r.message.resize(len);
  if (len) ch.recv_exact(&r.message[0], len, "response message");
  return r;
}

void send_trailer(Channel& ch, uint64_t nbytes, uint32_t crc) {
  uint8_t t[kTrailerBytes];
  put_u64(t, nbytes);
  put_u32(t + 8, crc);
  put_u32(t + 12, kTrailerMagic);
  ch.send_all(t, sizeof(t), "trailer");
}

// --- paths --------------------------------------------------------------------------------

// Opens (and with create, makes) the directories comps[0..count-1] under base_fd, one
// component at a time with O_NOFOLLOW, so nothing resolves outside the base directory.
Fd open_confined_dirs(int base_fd, const std::vector<std::string>& comps, size_t count, const std::string& path,
                      bool create) {
  Fd cur(::fcntl(base_fd, F_DUPFD_CLOEXEC, 0));
  if (cur.get() < 0) throw OsError(errno, "dup of the base directory failed", "");
  for (size_t i = 0; i < count; ++i) {
    int fd = ::openat(cur.get(), comps[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && create) {
      if (::mkdirat(cur.get(), comps[i].c_str(), 0755) != 0 && errno != EEXIST)
        throw OsError(errno, "cannot create directory " + quoted(comps[i]) + " for " + quoted(path), path);
      fd = ::openat(cur.get(), comps[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
      const int err = errno;
      if (err == ELOOP || err == ENOTDIR)
        throw TransferPathError("path " + quoted(path) + " refused: component " + quoted(comps[i]) +
                                " is a symlink or not a directory");
      if (err == ENOENT) throw OsError(ENOENT, "object " + quoted(path) + " not found: no directory " + quoted(comps[i]), path);
      throw OsError(err, "cannot open directory " + quoted(comps[i]) + " of " + quoted(path), path);
    }
    cur = Fd(fd);
  }
  return cur;
}

// The directory that holds the object at comps (every component but the last), confined.
Fd open_parent_dir(int base_fd, const std::vector<std::string>& comps, const std::string& path, bool create) {
  return open_confined_dirs(base_fd, comps, comps.size() - 1, path, create);
}

// The spare directory (relative to base_fd), confined; an empty Fd when it is not configured or
// does not exist (yet). Spares only speed receptions up, so any other problem also means "none".
Fd open_spare_dir(int base_fd, const std::string& spare_dir) {
  if (spare_dir.empty()) return Fd();
  try {
    const auto comps = split_relative_path(spare_dir);
    return open_confined_dirs(base_fd, comps, comps.size(), spare_dir, false);
  } catch (const std::exception&) {
    return Fd();
  }
}

// Opens an existing regular file under base_fd for reading, confined.
Fd open_confined_for_read(int base_fd, const std::string& path, uint64_t* size_out) {
  const auto comps = split_relative_path(path);
  Fd dir = open_parent_dir(base_fd, comps, path, false);
  const int fd = ::openat(dir.get(), comps.back().c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) throw TransferPathError("path " + quoted(path) + " refused: it is a symlink");
    if (err == ENOENT) throw OsError(ENOENT, "object " + quoted(path) + " not found", path);
    throw OsError(err, "cannot open " + quoted(path), path);
  }
  Fd file(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) throw OsError(errno, "fstat failed", path);
  if (!S_ISREG(st.st_mode)) throw TransferPathError("path " + quoted(path) + " refused: not a regular file");
  // Back to blocking for pread (O_NONBLOCK only kept a FIFO from blocking the open).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  *size_out = static_cast<uint64_t>(st.st_size);
  return file;
}

// --- receiving into warm pages ------------------------------------------------------------

constexpr uint64_t kMinMappedBytes = uint64_t(1) << 20;   // below this pwrite costs less than a mapping
constexpr uint64_t kPopulateWindow = uint64_t(4) << 20;   // populated at a time, ahead of the receiver
constexpr int kMadvPopulateRead = 22;                     // MADV_POPULATE_READ (Linux 5.14)

// A writable shared mapping of the first `length` bytes of a file whose pages all exist (a
// spare's). A helper thread populates it window by window just ahead of the receiver, on the
// otherwise idle core, with MADV_POPULATE_READ: that reports a page the kernel cannot provide
// as an error instead of a SIGBUS at the first write (and on tmpfs a shared mapping's read
// faults map the pages writable, so the writes then take no faults at all). The receiver only
// writes below the populated frontier; a failed populate stops the frontier and the rest of the
// object goes through pwrite. Mapping and thread cost far less than pwrite's extra copy.
class WarmMapping {
 public:
  // nullptr when the file cannot be mapped (the caller then uses pwrite).
  static std::unique_ptr<WarmMapping> map(int fd, uint64_t length) {
    void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return nullptr;
    std::unique_ptr<WarmMapping> m(new WarmMapping(static_cast<uint8_t*>(p), length));
    try {
      m->populator_ = std::thread([raw = m.get()] { raw->populate_all(); });
    } catch (const std::exception&) {
      return nullptr;  // no thread: unmapped by the destructor, pwrite instead
    }
    return m;
  }
  ~WarmMapping() {
    settle();
    ::munmap(data_, length_);
  }
  WarmMapping(const WarmMapping&) = delete;
  WarmMapping& operator=(const WarmMapping&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t length() const { return length_; }

  // Stops populating (at once if still running) and joins the thread.
  void settle() {
    stop_.store(true);
    if (populator_.joinable()) populator_.join();
  }
  // True once every page of the mapping was populated (then it is worth keeping).
  bool fully_populated() const { return populated_.load() == length_; }

  // Waits until [0, end) is populated or populating stopped; returns the populated end, <= end.
  uint64_t wait_populated(uint64_t end) {
    uint64_t ready = populated_.load(std::memory_order_acquire);
    if (ready < end) {
      std::unique_lock<std::mutex> lk(m_);
      cv_.wait(lk, [&] { return (ready = populated_.load(std::memory_order_acquire)) >= end || finished_; });
    }
    return std::min(ready, end);
  }

 private:
  WarmMapping(uint8_t* data, uint64_t length) : data_(data), length_(length) {}

  void populate_all() {
    uint64_t at = 0;
    while (at < length_ && !stop_.load()) {
      const uint64_t n = std::min(kPopulateWindow, length_ - at);
      if (::madvise(data_ + at, n, kMadvPopulateRead) != 0) break;  // old kernel, no memory: stop here
      at += n;
      {
        std::lock_guard<std::mutex> lk(m_);  // so that a receiver about to wait cannot miss it
        populated_.store(at, std::memory_order_release);
      }
      cv_.notify_all();
    }
    {
      std::lock_guard<std::mutex> lk(m_);
      finished_ = true;
    }
    cv_.notify_all();
  }

  uint8_t* data_;
  uint64_t length_;
  std::atomic<uint64_t> populated_{0};
  std::atomic<bool> stop_{false};
  bool finished_ = false;
  std::mutex m_;
  std::condition_variable cv_;
  std::thread populator_;
};

}  // namespace

// Mappings of files this server received into, kept after the reception: the file becomes a
// replica, is retired into the spare directory (renamed, same inode) and is taken back by a
// later reception, which then writes through the kept mapping with no page-table set-up and
// no tear-down (about a sixth of a steady reception's CPU time). Holding a mapping keeps the
// memory of a file deleted meanwhile alive, so entries of deleted files are dropped at every
// use and every second, and only a few mappings are kept.
class WarmMappingCache {
 public:
  // The kept mapping of this file (now the caller's), if it covers at least length bytes.
  std::unique_ptr<WarmMapping> take(const struct stat& st, uint64_t length) {
    drop_deleted();
    std::unique_ptr<WarmMapping> found;
    std::lock_guard<std::mutex> lk(m_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->dev == st.st_dev && it->ino == st.st_ino) {
        if (it->map->length() >= length) found = std::move(it->map);
        graveyard_.push_back(std::move(*it));  // a shorter mapping is dropped: a new one replaces it
        entries_.erase(it);
        break;
      }
    }
    return found;
  }

  bool holds(dev_t dev, ino_t ino) {
    std::lock_guard<std::mutex> lk(m_);
    for (const auto& e : entries_)
      if (e.dev == dev && e.ino == ino) return true;
    return false;
  }

  // Keeps the fully populated mapping of a file that was just committed (fd stays open here).
  void keep(int fd, std::unique_ptr<WarmMapping> map) {
    if (!map) return;
    map->settle();
    struct stat st;
    if (!map->fully_populated() || ::fstat(fd, &st) != 0) return;
    Fd file(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (file.get() < 0) return;
    std::vector<Entry> evicted;
    {
      std::lock_guard<std::mutex> lk(m_);
      entries_.push_back({st.st_dev, st.st_ino, std::move(file), std::move(map)});
      while (entries_.size() > kMaxEntries) {
        evicted.push_back(std::move(entries_.front()));
        entries_.pop_front();
      }
    }
    drop_deleted();
  }

  // Unmaps the mappings of files that no longer exist, releasing their memory.
  void drop_deleted() {
    std::vector<Entry> dropped;
    {
      std::lock_guard<std::mutex> lk(m_);
      dropped.swap(graveyard_);
      for (auto it = entries_.begin(); it != entries_.end();) {
        struct stat st;
        if (::fstat(it->file.get(), &st) != 0 || st.st_nlink == 0) {
          dropped.push_back(std::move(*it));
          it = entries_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }  // munmap (in the entries' destructors) outside the lock

  void clear() {
    std::deque<Entry> all;
    std::vector<Entry> graves;
    std::lock_guard<std::mutex> lk(m_);
    all.swap(entries_);
    graves.swap(graveyard_);
  }

 private:
  static constexpr size_t kMaxEntries = 8;  // two per steady stream of pushes: the newest replica and the one before
  struct Entry {
    dev_t dev;
    ino_t ino;
    Fd file;
    std::unique_ptr<WarmMapping> map;
  };
  std::mutex m_;
  std::deque<Entry> entries_;     // oldest first
  std::vector<Entry> graveyard_;  // taken out under the lock, unmapped outside it
};

namespace {

// --- spare files --------------------------------------------------------------------------
//
// A spare is a retired replica's file, parked in the spare directory so that the next
// reception overwrites tmpfs pages that already exist instead of faulting in and zeroing
// fresh ones (about twice as fast here). A reception takes a spare by renaming it into the
// destination directory under its hidden temporary name: rename is atomic, so two receptions
// can never take the same spare (the loser's rename fails with ENOENT and it tries the next).

constexpr size_t kMaxSpareCandidates = 4096;  // bounds the work of one directory scan

struct SpareCandidate {
  std::string name;
  uint64_t size;
  bool mapped;  // this server still has a mapping of it: no page-table set-up needed
};

// Regular, singly linked, non-hidden files of the spare directory; anything else is ignored.
std::vector<SpareCandidate> list_spares(int spare_fd, WarmMappingCache* cache) {
  std::vector<SpareCandidate> out;
  const int dup_fd = ::fcntl(spare_fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return out;
  DIR* dir = ::fdopendir(dup_fd);
  if (!dir) {
    ::close(dup_fd);
    return out;
  }
  while (out.size() < kMaxSpareCandidates) {
    errno = 0;
    const struct dirent* e = ::readdir(dir);
    if (!e) break;
    if (e->d_name[0] == '.') continue;
    struct stat st;
    if (::fstatat(spare_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1 || st.st_size <= 0) continue;
    out.push_back({e->d_name, static_cast<uint64_t>(st.st_size), cache && cache->holds(st.st_dev, st.st_ino)});
  }
  ::closedir(dir);
  return out;
}

// Preference order for an object of size bytes: the smallest spare that holds it (one still
// mapped here first), then the other spares from the largest down (the more warm pages the better).
void order_spares(std::vector<SpareCandidate>& spares, uint64_t size) {
  std::sort(spares.begin(), spares.end(), [size](const SpareCandidate& a, const SpareCandidate& b) {
    const bool a_fits = a.size >= size, b_fits = b.size >= size;
    if (a_fits != b_fits) return a_fits;
    if (a_fits && a.mapped != b.mapped) return a.mapped;
    return a_fits ? a.size < b.size : a.size > b.size;
  });
}

// A hidden temporary file in the destination directory; removed unless commit() ran. Its
// pages come from a spare file when spare_fd names a spare directory that holds one.
class TempObject {
 public:
  TempObject(int base_fd, const std::string& path, uint64_t size, int spare_fd = -1,
             WarmMappingCache* cache = nullptr)
      : path_(path), cache_(cache) {
    const auto comps = split_relative_path(path);
    final_name_ = comps.back();
    dir_ = open_parent_dir(base_fd, comps, path, true);
    temp_name_ = ".xfer-" + random_hex(8) + ".tmp";
    if (spare_fd >= 0 && size > 0) take_spare(spare_fd, size);
    check_space(size > warm_bytes_ ? size - warm_bytes_ : 0);
    if (file_.get() < 0) create_file();
    if (::ftruncate(file_.get(), static_cast<off_t>(size)) != 0) {
      const int err = errno;
      discard();
      throw OsError(err, "cannot size the temporary file for " + quoted(path), path);
    }
  }
  ~TempObject() { discard(); }
  int fd() const { return file_.get(); }
  // Bytes at the start of the file whose pages already exist (taken from a spare).
  uint64_t warm_bytes() const { return warm_bytes_; }
  bool from_spare() const { return from_spare_; }

  // A mapping of the whole pages among the warm bytes (the cache's, else a new one), or nullptr
  // (too few, or it failed). It lives as long as this object, so unmapping (or handing it to
  // the cache) waits until the reply has been sent. Only its first mapped_bytes() are written.
  WarmMapping* map_warm_pages() {
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    mapped_bytes_ = warm_bytes_ / page * page;
    if (map_ || mapped_bytes_ < kMinMappedBytes) return map_.get();
    if (cache_) map_ = cache_->take(spare_stat_, mapped_bytes_);
    mapping_reused_ = map_ != nullptr;
    if (!map_) map_ = WarmMapping::map(file_.get(), mapped_bytes_);
    return map_.get();
  }
  uint64_t mapped_bytes() const { return mapped_bytes_; }
  bool mapping_reused() const { return mapping_reused_; }

  void write_at(const void* data, size_t n, uint64_t offset) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(file_.get(), p, n, static_cast<off_t>(offset));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw OsError(errno, "writing " + quoted(path_) + " failed", path_);
      }
      p += w;
      n -= static_cast<size_t>(w);
      offset += static_cast<uint64_t>(w);
    }
  }

  // fsync, rename over the final name, fsync the directory.
  void commit() {
    if (::fsync(file_.get()) != 0) throw OsError(errno, "fsync of " + quoted(path_) + " failed", path_);
    if (::renameat(dir_.get(), temp_name_.c_str(), dir_.get(), final_name_.c_str()) != 0)
      throw OsError(errno, "cannot rename the received object into place as " + quoted(path_), path_);
    committed_ = true;
    ::fsync(dir_.get());
  }

 private:
  // Fail early and clearly when the file system cannot hold the new pages. (Space is not
  // reserved with fallocate: that costs a full extra pass over the pages; the pages are
  // allocated as the data lands, and ENOSPC then still ends the transfer cleanly.)
  void check_space(uint64_t new_bytes) {
    struct statvfs vfs;
    if (new_bytes > 0 && ::fstatvfs(dir_.get(), &vfs) == 0 && vfs.f_frsize > 0 &&
        new_bytes / vfs.f_frsize > static_cast<uint64_t>(vfs.f_bavail)) {
      const int err = ENOSPC;
      discard();
      throw OsError(err,
                    "cannot store " + std::to_string(new_bytes) + " more bytes for " + quoted(path_) + " (only " +
                        std::to_string(uint64_t(vfs.f_bavail) * vfs.f_frsize) + " bytes free)",
                    path_);
    }
  }

  void create_file() {
    const int fd = ::openat(dir_.get(), temp_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) throw OsError(errno, "cannot create a temporary file for " + quoted(path_), path_);
    file_ = Fd(fd);
    created_ = true;
  }

  // Moves the best spare here under temp_name_; on any doubt the spare is skipped.
  void take_spare(int spare_fd, uint64_t size) {
    auto spares = list_spares(spare_fd, cache_);
    order_spares(spares, size);
    for (const auto& spare : spares) {
      if (::renameat(spare_fd, spare.name.c_str(), dir_.get(), temp_name_.c_str()) != 0) {
        if (errno == ENOENT) continue;  // another reception took it first
        return;                         // EXDEV (another file system) or worse: no spares here
      }
      created_ = true;  // from here on the destructor removes it unless it goes back
      if (adopt_taken_spare(size)) return;
      // Not a plain file any more (replaced between the scan and the rename): put it back.
      created_ = false;
      if (::renameat(dir_.get(), temp_name_.c_str(), spare_fd, spare.name.c_str()) != 0) {
        if (::unlinkat(dir_.get(), temp_name_.c_str(), 0) != 0) temp_name_ = ".xfer-" + random_hex(8) + ".tmp";
        return;  // something odd is going on in the spare directory: no more spares this time
      }
    }
  }

  // Opens the spare just renamed to temp_name_; true if it is a regular file linked only here.
  bool adopt_taken_spare(uint64_t size) {
    const int fd = ::openat(dir_.get(), temp_name_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return false;
    Fd file(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) return false;
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    // Only pages the spare really holds count as warm (a sparse spare has holes).
    const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
    const uint64_t length = static_cast<uint64_t>(st.st_size);
    warm_bytes_ = allocated >= length ? std::min(length, size) : 0;
    spare_stat_ = st;
    file_ = std::move(file);
    from_spare_ = true;
    return true;
  }

  void discard() {
    if (committed_ && cache_) cache_->keep(file_.get(), std::move(map_));
    map_.reset();
    file_.reset();
    if (created_ && !committed_) ::unlinkat(dir_.get(), temp_name_.c_str(), 0);
    created_ = false;
  }

  std::string path_, final_name_, temp_name_;
  Fd dir_, file_;
  WarmMappingCache* cache_;
  std::unique_ptr<WarmMapping> map_;
  struct stat spare_stat_ {};
  uint64_t warm_bytes_ = 0, mapped_bytes_ = 0;
  bool created_ = false, committed_ = false, from_spare_ = false, mapping_reused_ = false;
};

// Checks the trailer that follows the data against the length and CRC32C received.
void check_trailer(Channel& ch, uint64_t size, uint32_t crc) {
  uint8_t t[kTrailerBytes];
  ch.recv_exact(t, sizeof(t), "trailer");
  if (get_u32(t + 12) != kTrailerMagic) throw TransferError("malformed trailer (bad end magic)");
  const uint64_t their_n = get_u64(t);
  const uint32_t their_crc = get_u32(t + 8);
  if (their_n != size)
    throw TransferChecksumError("length mismatch: the sender announced " + std::to_string(size) +
                                " bytes but its trailer says " + std::to_string(their_n));
  if (their_crc != crc) {
    char msg[160];
    std::snprintf(msg, sizeof(msg), "CRC32C mismatch: the sender's is %08x, the received bytes give %08x", their_crc,
                  crc);
    throw TransferChecksumError(msg);
  }
}

// Receives [0, n) straight into the warm mapping, CRC'ing each piece while it is hot, never
// past what the populating thread has made ready. Returns the bytes received there: n, or less
// when populating stopped early (the caller then pwrites the rest).
uint64_t receive_into_mapping(Channel& ch, WarmMapping& map, uint64_t n, size_t chunk, uint32_t* crc) {
  uint64_t done = 0;
  while (done < n) {
    const uint64_t ready = map.wait_populated(std::min<uint64_t>(done + chunk, n));
    if (ready <= done) break;
    const size_t got = ch.recv_some(map.data() + done, static_cast<size_t>(ready - done), "object data");
    *crc = crc32c(map.data() + done, got, *crc);
    done += got;
  }
  return done;
}

// Receives [done, size) through buf: each chunk CRC'd while hot, then pwritten.
uint32_t receive_by_pwrite(Channel& ch, TempObject& out, uint64_t done, uint64_t size, uint32_t crc,
                           std::vector<uint8_t>& buf) {
  while (done < size) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    const size_t got = ch.recv_some(buf.data(), want, "object data");
    crc = crc32c(buf.data(), got, crc);
    out.write_at(buf.data(), got, done);
    done += got;
  }
  return crc;
}

// Receives size bytes into the temp object, then the trailer; returns the CRC32C of the data.
// The part that lands on a spare's existing pages is received straight into a mapping of them
// (one copy: socket -> page); the rest, and everything when there is no spare, is received into
// buf and pwritten (two copies, but pwrite allocates new pages safely: no SIGBUS on ENOSPC).
// Throws TransferChecksumError when the trailer's length or CRC disagrees.
uint32_t receive_object(Channel& ch, TempObject& out, uint64_t size, std::vector<uint8_t>& buf) {
  uint32_t crc = 0;
  uint64_t done = 0;
  if (WarmMapping* map = out.map_warm_pages()) done = receive_into_mapping(ch, *map, out.mapped_bytes(), buf.size(), &crc);
  crc = receive_by_pwrite(ch, out, done, size, crc, buf);
  check_trailer(ch, size, crc);
  return crc;
}

// Reads n bytes at offset; end is where the range being sent ends (for the message).
void pread_exactly(int file_fd, uint8_t* dst, size_t n, uint64_t offset, uint64_t end) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(file_fd, dst + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw OsError(errno, "reading the object to send failed", "");
    }
    if (r == 0)
      throw ShortReadError("source file ended at " + std::to_string(offset + got) + " bytes, before the " +
                           std::to_string(end) + " being sent (was it truncated?)");
    got += static_cast<size_t>(r);
  }
}

// Sends [offset, offset+size) of file_fd: each chunk is pread into buf and CRC'd (page cache ->
// L2), then sent with sendfile() (no copy into the socket) or send() from buf. Returns the CRC.
uint32_t send_object(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                     std::vector<uint8_t>& buf) {
  uint32_t crc = 0;
  uint64_t done = 0;
  bool use_sendfile = zero_copy;
  while (done < size) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    pread_exactly(file_fd, buf.data(), n, offset + done, offset + size);
    crc = crc32c(buf.data(), n, crc);
    if (use_sendfile) use_sendfile = ch.sendfile_all(file_fd, offset + done, n);
    if (!use_sendfile) ch.send_all(buf.data(), n, "object data");
    done += n;
  }
  return crc;
}

// Sends [offset, offset+size) of file_fd whose CRC32C the caller already knows (from the
// object's index), so the data is never read into user space: one sendfile() for the whole
// range, or pread + send when the kernel cannot sendfile from this file (or zero_copy is off).
// The receiver still checks the bytes against that CRC.
void send_object_known_crc(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                           std::vector<uint8_t>& buf) {
  if (size == 0) return;
  if (zero_copy && ch.sendfile_all(file_fd, offset, size)) return;
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    pread_exactly(file_fd, buf.data(), n, offset + done, offset + size);
    ch.send_all(buf.data(), n, "object data");
    done += n;
  }
}

// --- client plumbing ----------------------------------------------------------------------

Fd connect_to(const std::string& host, int port, double timeout_s) {
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  struct addrinfo* res = nullptr;
  const std::string port_s = std::to_string(port);
  const int gai = ::getaddrinfo(host.c_str(), port_s.c_str(), &hints, &res);
  if (gai != 0) throw TransferError("cannot resolve " + quoted(host) + ": " + gai_strerror(gai));
  std::unique_ptr<struct addrinfo, void (*)(struct addrinfo*)> guard(res, ::freeaddrinfo);
  const std::string where = host + ":" + port_s;
  std::string last_error = "no address";
  bool timed_out = false;
  const auto deadline = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  for (struct addrinfo* ai = res; ai; ai = ai->ai_next) {
    Fd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (s.get() < 0) {
      last_error = errno_text(errno);
      continue;
    }
    int rc = ::connect(s.get(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS && errno != EINTR) {
      last_error = errno_text(errno);
      continue;
    }
    if (rc != 0) {
      for (;;) {
        const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
        struct pollfd p = {s.get(), POLLOUT, 0};
        const int r = left > 0 ? ::poll(&p, 1, timeout_ms(left)) : 0;
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          timed_out = true;
          last_error = "timed out";
          break;
        }
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) last_error = errno_text(err);
        else rc = 0;
        break;
      }
      if (rc != 0) continue;
    }
    set_socket_options(s.get());
    return s;
  }
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.3g", timeout_s);
  if (timed_out) throw TransferTimeoutError("connect to " + where + " timed out after " + secs + " s");
  throw TransferError("connect to " + where + " failed: " + last_error);
}

[[noreturn]] void throw_for_status(const Response& r, const std::string& context) {
  const std::string msg = context + ": peer answered " + status_name(r.status) + ": " + r.message;
  switch (r.status) {
    case kPathRefused: throw TransferPathError(msg);
    case kNotFound: throw TransferNotFoundError(msg);
    case kChecksum: throw TransferChecksumError(msg);
    case kBadRequest:
    case kTooLarge:
    case kIoError:
    default: throw TransferRefusedError(msg);
  }
}

void check_client_args(const std::string& secret, int port, const TransferOptions& o) {
  if (secret.size() < kTransferMinSecretBytes)
    throw std::invalid_argument("secret must be at least " + std::to_string(kTransferMinSecretBytes) + " bytes");
  if (port <= 0 || port > 65535) throw std::invalid_argument("port must be in 1..65535");
  if (!(o.connect_timeout_s > 0) || !(o.io_timeout_s > 0)) throw std::invalid_argument("timeouts must be > 0");
  if (o.retries < 0 || o.retries > 100) throw std::invalid_argument("retries must be in 0..100");
  if (!(o.backoff_s >= 0) || o.backoff_s > 3600) throw std::invalid_argument("backoff_s must be in [0, 3600]");
}

Fd open_base_dir(const std::string& dir) {
  if (dir.empty()) throw std::invalid_argument("base directory must not be empty");
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw OsError(errno, "cannot open base directory " + quoted(dir), dir);
  return Fd(fd);
}

template <typename Attempt>
TransferResult with_retries(const TransferOptions& o, const std::string& what, Attempt attempt) {
  const auto start = Clock::now();
  enum { kGeneric, kTimeout, kCrc } last_kind = kGeneric;
  std::string last;
  const int attempts = 1 + o.retries;
  for (int i = 0; i < attempts; ++i) {
    if (i > 0) {
      const double pause = o.backoff_s * std::ldexp(1.0, i - 1);
      if (pause > 0) std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(pause * 1e6)));
    }
    try {
      TransferResult r = attempt();
      r.attempts = i + 1;
      r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      return r;
    } catch (const TransferAuthError& e) {
      throw TransferAuthError(what + ": " + e.what());
    } catch (const TransferRefusedError&) {
      throw;  // the peer's message already names the path
    } catch (const TransferTimeoutError& e) {
      last_kind = kTimeout;
      last = e.what();
    } catch (const TransferChecksumError& e) {
      last_kind = kCrc;
      last = e.what();
    } catch (const TransferError& e) {
      last_kind = kGeneric;
      last = e.what();
    }
  }
  const std::string msg = what + " failed after " + std::to_string(attempts) + " attempt(s): " + last;
  if (last_kind == kTimeout) throw TransferTimeoutError(msg);
  if (last_kind == kCrc) throw TransferChecksumError(msg);
  throw TransferError(msg);
}

void send_request(Channel& ch, uint32_t op, const std::string& path, uint64_t size) {
  std::vector<uint8_t> buf(kRequestBytes + path.size());
  put_u32(buf.data(), op);
  put_u32(buf.data() + 4, static_cast<uint32_t>(path.size()));
  put_u64(buf.data() + 8, size);
  put_u32(buf.data() + 16, 0);
  put_u32(buf.data() + 20, 0);
  std::memcpy(buf.data() + kRequestBytes, path.data(), path.size());
  ch.send_all(buf.data(), buf.size(), "request");
}

TransferResult push_attempt(const std::string& host, int port, const std::string& secret, int fd, uint64_t offset,
                            uint64_t size, const std::string& remote_path, const TransferOptions& o,
                            std::vector<uint8_t>& buf) {
  Fd sock = connect_to(host, port, o.connect_timeout_s);
  Channel ch(sock.get(), o.io_timeout_s, -1);
  ch.set_deadline(o.io_timeout_s);
  client_handshake(ch, secret);
  send_request(ch, kOpPush, remote_path, size);
  Response ready = recv_response(ch);
  if (ready.status != kOk) throw_for_status(ready, "push of " + quoted(remote_path));
  ch.clear_deadline();
  TransferResult r;
  if (o.has_known_crc) {
    send_object_known_crc(ch, fd, offset, size, o.zero_copy, buf);
    r.crc32c = o.known_crc;
  } else {
    r.crc32c = send_object(ch, fd, offset, size, o.zero_copy, buf);
  }
  send_trailer(ch, size, r.crc32c);
  Response done = recv_response(ch);
  if (done.status != kOk) throw_for_status(done, "push of " + quoted(remote_path));
  r.nbytes = size;
  return r;
}

std::string describe(const char* op, const std::string& path, const std::string& host, int port) {
  return std::string(op) + " of " + quoted(path) + " to " + host + ":" + std::to_string(port);
}

}  // namespace

std::vector<std::string> split_relative_path(const std::string& path) {
  auto refuse = [&](const std::string& why) -> void {
    throw TransferPathError("path " + quoted(path) + " refused: " + why);
  };
  if (path.empty()) refuse("empty");
  if (path.size() > kTransferMaxPathBytes)
    refuse("longer than " + std::to_string(kTransferMaxPathBytes) + " bytes (" + std::to_string(path.size()) + ")");
  if (path.find('\0') != std::string::npos) refuse("contains a NUL byte");
  if (path[0] == '/') refuse("absolute paths are not allowed");
  std::vector<std::string> comps;
  size_t start = 0;
  for (;;) {
    const size_t slash = path.find('/', start);
    const std::string comp = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (comp.empty()) refuse("empty path component");
    if (comp == "." || comp == "..") refuse("'" + comp + "' components are not allowed");
    if (comp.size() > 255) refuse("a component is longer than 255 bytes");
    comps.push_back(comp);
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return comps;
}

TransferResult transfer_push_path(const std::string& host, int port, const std::string& secret,
                                  const std::string& local_base_dir, const std::string& path,
                                  const std::string& remote_path_in, const TransferOptions& o) {
  check_client_args(secret, port, o);
  const std::string remote_path = remote_path_in.empty() ? path : remote_path_in;
  split_relative_path(path);
  split_relative_path(remote_path);
  Fd base = open_base_dir(local_base_dir);
  uint64_t size = 0;
  Fd file = open_confined_for_read(base.get(), path, &size);
  std::vector<uint8_t> buf(kChunkBytes);
  return with_retries(o, describe("push", remote_path, host, port), [&] {
    return push_attempt(host, port, secret, file.get(), 0, size, remote_path, o, buf);
  });
}

TransferResult transfer_push_fd(const std::string& host, int port, const std::string& secret, int fd,
                                uint64_t offset, uint64_t length, const std::string& remote_path,
                                const TransferOptions& o) {
  check_client_args(secret, port, o);
  split_relative_path(remote_path);
  struct stat st;
  if (::fstat(fd, &st) != 0) throw OsError(errno, "fstat of the file to push failed", "");
  if (!S_ISREG(st.st_mode)) throw std::invalid_argument("fd must refer to a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (offset > file_size) throw std::invalid_argument("offset is past the end of the file");
  if (length == UINT64_MAX) length = file_size - offset;
  if (length > file_size - offset) throw std::invalid_argument("offset + length is past the end of the file");
  std::vector<uint8_t> buf(kChunkBytes);
  return with_retries(o, describe("push", remote_path, host, port), [&] {
    return push_attempt(host, port, secret, fd, offset, length, remote_path, o, buf);
  });
}

TransferResult transfer_fetch(const std::string& host, int port, const std::string& secret,
                              const std::string& remote_path, const std::string& local_base_dir,
                              const std::string& local_path_in, const TransferOptions& o) {
  check_client_args(secret, port, o);
  const std::string local_path = local_path_in.empty() ? remote_path : local_path_in;
  split_relative_path(remote_path);
  split_relative_path(local_path);
  if (!o.spare_dir.empty()) split_relative_path(o.spare_dir);
  Fd base = open_base_dir(local_base_dir);
  std::vector<uint8_t> buf(kChunkBytes);
  const std::string what = "fetch of " + quoted(remote_path) + " from " + host + ":" + std::to_string(port);
  return with_retries(o, what, [&] {
    Fd sock = connect_to(host, port, o.connect_timeout_s);
    Channel ch(sock.get(), o.io_timeout_s, -1);
    ch.set_deadline(o.io_timeout_s);
    client_handshake(ch, secret);
    send_request(ch, kOpFetch, remote_path, 0);
    Response head = recv_response(ch);
    if (head.status != kOk) throw_for_status(head, "fetch of " + quoted(remote_path));
    ch.clear_deadline();
    const uint64_t size = head.value;
    if (size > o.max_object_bytes) {
      const std::string msg = "object of " + std::to_string(size) + " bytes exceeds max_object_bytes " +
                              std::to_string(o.max_object_bytes);
      try {
        send_response(ch, kTooLarge, 0, msg);
      } catch (const std::exception&) {
      }
      throw TransferRefusedError("fetch of " + quoted(remote_path) + " refused: " + msg);
    }
    Fd spares = open_spare_dir(base.get(), o.spare_dir);
    TempObject tmp(base.get(), local_path, size, spares.get());
    TransferResult r;
    try {
      r.crc32c = receive_object(ch, tmp, size, buf);
    } catch (const TransferChecksumError& e) {
      try {
        send_response(ch, kChecksum, 0, e.what());
      } catch (const std::exception&) {
      }
      throw;
    }
    tmp.commit();
    r.nbytes = size;
    try {
      send_response(ch, kOk, size, "stored");
    } catch (const std::exception&) {
      // The object is in place and verified; a lost acknowledgement changes nothing here.
    }
    return r;
  });
}

double raw_tcp_seconds(uint64_t nbytes, size_t chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes > (size_t(64) << 20)) throw std::invalid_argument("chunk_bytes must be in 1..64 MiB");
  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) throw OsError(errno, "socket failed", "");
  struct sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) throw OsError(errno, "bind failed", "");
  if (::listen(listener.get(), 1) != 0) throw OsError(errno, "listen failed", "");
  socklen_t len = sizeof(addr);
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len);

  std::exception_ptr receiver_error;
  std::thread receiver([&] {
    try {
      Fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.get() < 0) throw OsError(errno, "accept failed", "");
      std::vector<uint8_t> sink(chunk_bytes);
      uint64_t got = 0;
      while (got < nbytes) {
        const ssize_t r = ::recv(conn.get(), sink.data(), std::min<uint64_t>(sink.size(), nbytes - got), 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) throw TransferError("raw receiver: connection ended early");
        got += static_cast<uint64_t>(r);
      }
      const uint8_t ack = 1;
      ::send(conn.get(), &ack, 1, MSG_NOSIGNAL);
    } catch (...) {
      receiver_error = std::current_exception();
    }
  });
  std::vector<uint8_t> src(chunk_bytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 131 + 7);
  double seconds = 0;
  try {
    Fd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) throw OsError(errno, "connect failed", "");
    set_socket_options(sock.get());
    const auto start = Clock::now();
    uint64_t sent = 0;
    while (sent < nbytes) {
      const ssize_t r = ::send(sock.get(), src.data(), std::min<uint64_t>(src.size(), nbytes - sent), MSG_NOSIGNAL);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw OsError(errno, "raw send failed", "");
      sent += static_cast<uint64_t>(r);
    }
    uint8_t ack = 0;
    while (::recv(sock.get(), &ack, 1, 0) < 0 && errno == EINTR) {
    }
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  } catch (...) {
    ::shutdown(listener.get(), SHUT_RDWR);
    receiver.join();
    throw;
  }
  receiver.join();
  if (receiver_error) std::rethrow_exception(receiver_error);
  return seconds;
}

// --- server -------------------------------------------------------------------------------

TransferServer::TransferServer(const TransferServerConfig& config) : config_(config) {
  if (config_.secret.size() < kTransferMinSecretBytes)
    throw std::invalid_argument("secret must be at least " + std::to_string(kTransferMinSecretBytes) + " bytes");
  if (config_.max_connections < 1 || config_.max_connections > 1024)
    throw std::invalid_argument("max_connections must be in 1..1024");
  if (config_.max_pending < 0 || config_.max_pending > 65536) throw std::invalid_argument("max_pending must be in 0..65536");
  if (config_.max_pending == 0) config_.max_pending = 4 * config_.max_connections;
  if (!(config_.io_timeout_s > 0) || config_.io_timeout_s > 86400) throw std::invalid_argument("io_timeout_s must be in (0, 86400]");
  if (config_.port < 0 || config_.port > 65535) throw std::invalid_argument("port must be in 0..65535");
  if (config_.max_object_bytes == 0) throw std::invalid_argument("max_object_bytes must be > 0");
  if (!config_.spare_dir.empty()) split_relative_path(config_.spare_dir);  // TransferPathError naming it

  Fd base = open_base_dir(config_.base_dir);
  mappings_.reset(new WarmMappingCache());
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  struct addrinfo* res = nullptr;
  const std::string port_s = std::to_string(config_.port);
  const int gai = ::getaddrinfo(config_.host.empty() ? nullptr : config_.host.c_str(), port_s.c_str(), &hints, &res);
  if (gai != 0) throw std::invalid_argument("cannot resolve host " + quoted(config_.host) + ": " + gai_strerror(gai));
  std::unique_ptr<struct addrinfo, void (*)(struct addrinfo*)> guard(res, ::freeaddrinfo);
  Fd listener(::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) throw OsError(errno, "socket failed", "");
  const int one = 1;
  ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listener.get(), res->ai_addr, res->ai_addrlen) != 0)
    throw OsError(errno, "cannot bind " + config_.host + ":" + port_s, "");
  if (::listen(listener.get(), 128) != 0) throw OsError(errno, "listen failed", "");
  struct sockaddr_storage bound;
  socklen_t blen = sizeof(bound);
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  Fd stop_event(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (stop_event.get() < 0) throw OsError(errno, "eventfd failed", "");

  base_fd_ = base.release();
  listen_fd_ = listener.release();
  stop_fd_ = stop_event.release();
  try {
    for (int i = 0; i < config_.max_connections; ++i) workers_.emplace_back([this] { worker_loop(); });
    accept_thread_ = std::thread([this] { accept_loop(); });
  } catch (...) {
    stop();
    throw;
  }
}

TransferServer::~TransferServer() { stop(); }

void TransferServer::stop() {
  std::lock_guard<std::mutex> once(stop_mutex_);
  if (stopped_.load()) return;
  {
    std::lock_guard<std::mutex> lk(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  const uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof(one)) < 0) {
    // An eventfd write only fails on overflow, which cannot happen with one write.
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
  for (auto& p : queue_) ::close(p.fd);
  queue_.clear();
  mappings_->clear();
  ::close(listen_fd_);
  ::close(stop_fd_);
  ::close(base_fd_);
  listen_fd_ = stop_fd_ = base_fd_ = -1;
  stopped_.store(true);
}

std::vector<std::string> TransferServer::take_errors() {
  std::lock_guard<std::mutex> lk(error_mutex_);
  std::vector<std::string> out;
  if (errors_dropped_ > 0) out.push_back(std::to_string(errors_dropped_) + " older error(s) dropped");
  out.insert(out.end(), errors_.begin(), errors_.end());
  errors_.clear();
  errors_dropped_ = 0;
  return out;
}

std::map<std::string, uint64_t> TransferServer::stats() const {
  return {{"accepted", accepted_.load()},
          {"rejected_busy", rejected_busy_.load()},
          {"auth_failures", auth_failures_.load()},
          {"protocol_failures", protocol_failures_.load()},
          {"pushes_ok", pushes_ok_.load()},
          {"fetches_ok", fetches_ok_.load()},
          {"transfer_failures", transfer_failures_.load()},
          {"bytes_received", bytes_received_.load()},
          {"bytes_sent", bytes_sent_.load()},
          {"spares_taken", spares_taken_.load()},
          {"mappings_reused", mappings_reused_.load()}};
}

void TransferServer::record_error(const std::string& message) {
  std::lock_guard<std::mutex> lk(error_mutex_);
  errors_.push_back(message);
  while (errors_.size() > 1000) {
    errors_.pop_front();
    ++errors_dropped_;
  }
}

void TransferServer::accept_loop() {
  for (;;) {
    struct pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const int r = ::poll(fds, 2, 1000);
    if (r < 0) {
      if (errno == EINTR) continue;
      record_error(std::string("accept loop: poll failed: ") + errno_text(errno));
      return;
    }
    mappings_->drop_deleted();  // at least once a second: a kept mapping must not pin a deleted file
    if (r == 0) continue;
    if (fds[1].revents & POLLIN) return;
    if (!(fds[0].revents & POLLIN)) continue;
    struct sockaddr_storage peer;
    socklen_t plen = sizeof(peer);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &plen, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) continue;
      record_error(std::string("accept failed: ") + errno_text(err));
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        struct pollfd s = {stop_fd_, POLLIN, 0};
        ::poll(&s, 1, 100);  // back off instead of spinning until descriptors free up
      }
      continue;
    }
    char host[INET6_ADDRSTRLEN] = "?";
    int pport = 0;
    if (peer.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&peer);
      ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      pport = ntohs(a->sin_port);
    } else if (peer.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&peer);
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      pport = ntohs(a->sin6_port);
    }
    const std::string name = std::string(host) + ":" + std::to_string(pport);
    accepted_.fetch_add(1);
    set_socket_options(fd);
    bool queued = false;
    {
      std::lock_guard<std::mutex> lk(queue_mutex_);
      if (!stopping_ && queue_.size() < static_cast<size_t>(config_.max_pending)) {
        queue_.push_back({fd, name});
        queued = true;
      }
    }
    if (queued) {
      queue_cv_.notify_one();
    } else {
      ::close(fd);
      rejected_busy_.fetch_add(1);
      record_error("peer " + name + ": connection refused, server busy (" + std::to_string(config_.max_pending) +
                   " connections already waiting)");
    }
  }
}

void TransferServer::worker_loop() {
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lk(queue_mutex_);
      queue_cv_.wait(lk, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      p = queue_.front();
      queue_.pop_front();
    }
    Fd conn(p.fd);
    try {
      handle(conn.get(), p.peer);
    } catch (const std::exception& e) {
      record_error("peer " + p.peer + ": " + e.what());
    } catch (...) {
      record_error("peer " + p.peer + ": unknown error");
    }
  }
}

namespace {
// A request refused after authentication: the status and message go back to the client.
struct Refusal {
  uint32_t status;
  std::string message;
};

Refusal refusal_for(const std::exception& e) {
  if (dynamic_cast<const TransferPathError*>(&e)) return {kPathRefused, e.what()};
  if (dynamic_cast<const TransferNotFoundError*>(&e)) return {kNotFound, e.what()};
  if (const auto* os = dynamic_cast<const OsError*>(&e)) {
    if (os->error_number() == ENOENT) return {kNotFound, e.what()};
    return {kIoError, e.what()};
  }
  return {kIoError, e.what()};
}
}  // namespace

namespace {
// After a refusal: stop sending and discard what the peer still sends (bounded: 200 ms, 1 MiB)
// before the close, so the close does not turn into a reset that destroys the response on its way.
void drain_briefly(int fd, int stop_fd) {
  ::shutdown(fd, SHUT_WR);
  const auto deadline = Clock::now() + std::chrono::milliseconds(200);
  char sink[16384];
  size_t total = 0;
  while (total < (size_t(1) << 20)) {
    const ssize_t r = ::recv(fd, sink, sizeof(sink), 0);
    if (r > 0) {
      total += static_cast<size_t>(r);
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return;
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0) return;
    struct pollfd fds[2] = {{fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    if (::poll(fds, 2, timeout_ms(left)) <= 0 || (fds[1].revents & POLLIN)) return;
  }
}
}  // namespace

void TransferServer::handle(int fd, const std::string& peer) {
  Channel ch(fd, config_.io_timeout_s, stop_fd_);
  ch.set_deadline(config_.io_timeout_s);
  try {
    server_handshake(ch, config_.secret);
  } catch (const TransferAuthError& e) {
    auth_failures_.fetch_add(1);
    record_error("peer " + peer + ": " + e.what());
    return;
  } catch (const std::exception& e) {
    protocol_failures_.fetch_add(1);
    record_error("peer " + peer + ": handshake failed: " + e.what());
    return;
  }

  uint8_t req[kRequestBytes];
  uint32_t op = 0, path_len = 0;
  uint64_t size = 0;
  std::string path;
  try {
    ch.recv_exact(req, sizeof(req), "request");
    op = get_u32(req);
    path_len = get_u32(req + 4);
    size = get_u64(req + 8);
    std::string bad;
    if (op != kOpPush && op != kOpFetch) bad = "unknown operation " + std::to_string(op);
    else if (path_len == 0 || path_len > kTransferMaxPathBytes)
      bad = "path length " + std::to_string(path_len) + " outside 1.." + std::to_string(kTransferMaxPathBytes);
    else if (get_u32(req + 16) != 0 || get_u32(req + 20) != 0) bad = "non-zero reserved request fields";
    else if (op == kOpFetch && size != 0) bad = "fetch request with a non-zero size";
    if (!bad.empty()) {
      protocol_failures_.fetch_add(1);
      record_error("peer " + peer + ": bad request: " + bad);
      send_response(ch, kBadRequest, 0, bad);
      drain_briefly(fd, stop_fd_);
      return;
    }
    path.resize(path_len);
    ch.recv_exact(&path[0], path_len, "request path");
  } catch (const std::exception& e) {
    protocol_failures_.fetch_add(1);
    record_error("peer " + peer + ": reading the request failed: " + e.what());
    return;
  }

  const std::string what = std::string(op == kOpPush ? "push" : "fetch") + " of " + quoted(path);
  auto refuse = [&](uint32_t status, const std::string& message) {
    transfer_failures_.fetch_add(1);
    record_error("peer " + peer + ": " + what + " refused (" + status_name(status) + "): " + message);
    try {
      send_response(ch, status, 0, message);
      drain_briefly(fd, stop_fd_);
    } catch (const std::exception&) {
    }
  };

  std::vector<uint8_t> buf(kChunkBytes);
  if (op == kOpPush) {
    if (size > config_.max_object_bytes) {
      refuse(kTooLarge, "object size " + std::to_string(size) + " exceeds max_object_bytes " +
                            std::to_string(config_.max_object_bytes));
      return;
    }
    std::unique_ptr<TempObject> tmp;
    try {
      Fd spares = open_spare_dir(base_fd_, config_.spare_dir);
      tmp.reset(new TempObject(base_fd_, path, size, spares.get(), mappings_.get()));
      if (tmp->from_spare()) spares_taken_.fetch_add(1);
    } catch (const std::exception& e) {
      const Refusal r = refusal_for(e);
      refuse(r.status == kNotFound ? kIoError : r.status, r.message);
      return;
    }
    try {
      send_response(ch, kOk, 0, "ready");
      ch.clear_deadline();
      try {
        receive_object(ch, *tmp, size, buf);
      } catch (const TransferChecksumError& e) {
        tmp.reset();  // the temporary file is gone before the sender hears about it
        refuse(kChecksum, std::string(e.what()) + "; object discarded");
        return;
      }
      bytes_received_.fetch_add(size);
      if (tmp->mapping_reused()) mappings_reused_.fetch_add(1);
      try {
        tmp->commit();
      } catch (const std::exception& e) {
        tmp.reset();
        refuse(kIoError, e.what());
        return;
      }
      pushes_ok_.fetch_add(1);
      try {
        send_response(ch, kOk, size, "stored");
      } catch (const std::exception& e) {
        record_error("peer " + peer + ": " + what + ": stored, but the acknowledgement was lost: " + e.what());
      }
      tmp.reset();  // unmapping the received pages waits until the sender has its answer
    } catch (const std::exception& e) {
      tmp.reset();
      transfer_failures_.fetch_add(1);
      record_error("peer " + peer + ": " + what + " failed: " + e.what() + " (nothing stored)");
    }
    return;
  }

  // FETCH
  Fd file;
  uint64_t file_size = 0;
  try {
    file = open_confined_for_read(base_fd_, path, &file_size);
  } catch (const std::exception& e) {
    const Refusal r = refusal_for(e);
    refuse(r.status, r.message);
    return;
  }
  if (file_size > config_.max_object_bytes) {
    refuse(kTooLarge, "object size " + std::to_string(file_size) + " exceeds max_object_bytes");
    return;
  }
  try {
    send_response(ch, kOk, file_size, "sending");
    ch.clear_deadline();
    const uint32_t crc = send_object(ch, file.get(), 0, file_size, true, buf);
    send_trailer(ch, file_size, crc);
    bytes_sent_.fetch_add(file_size);
    const Response ack = recv_response(ch);
    if (ack.status != kOk) {
      transfer_failures_.fetch_add(1);
      record_error("peer " + peer + ": " + what + ": the client reported " + status_name(ack.status) + ": " + ack.message);
      return;
    }
    fetches_ok_.fetch_add(1);
  } catch (const std::exception& e) {
    transfer_failures_.fetch_add(1);
    record_error("peer " + peer + ": " + what + " failed: " + e.what());
  }
}

}  // namespace flashpoint
