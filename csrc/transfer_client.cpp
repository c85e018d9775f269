// Client side of the transfer service: connect, handshake, push or fetch, with retries.
#include <netdb.h>
#include <sys/socket.h>

#include <thread>

#include "transfer.hpp"
#include "transfer_paths.hpp"
#include "transfer_space.hpp"
#include "transfer_stream.hpp"
#include "transfer_wire.hpp"

namespace flashpoint {
namespace {

using namespace xfer;

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
    case kIntegrity: throw TransferIntegrityError(msg);
    case kForbidden: throw TransferForbiddenError(msg);
    case kNoSpace: throw TransferNoSpaceError(msg);
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
  if (!(o.min_rate_bytes_per_s >= 0) || !std::isfinite(o.min_rate_bytes_per_s))
    throw std::invalid_argument("min_rate_bytes_per_s must be a finite number >= 0");
  if (o.rate_grace_s > 86400 || std::isnan(o.rate_grace_s)) throw std::invalid_argument("rate_grace_s must be <= 86400");
}

// Once the data flows: the minimum rate instead of the handshake budget.
void start_data_phase(Channel& ch, const TransferOptions& o) {
  ch.clear_deadline();
  ch.start_rate_floor(o.min_rate_bytes_per_s, o.rate_grace_s < 0 ? o.io_timeout_s : o.rate_grace_s);
}

// The ledger of this process's fetches that keep a margin of margin_bytes: concurrent fetches
// (recovery's threads) reserve against each other, not each against the free space alone.
SpaceLedger& fetch_ledger(int64_t margin_bytes) {
  static std::mutex m;
  static std::map<int64_t, std::unique_ptr<SpaceLedger>> ledgers;
  std::lock_guard<std::mutex> lk(m);
  std::unique_ptr<SpaceLedger>& ledger = ledgers[margin_bytes < 0 ? -1 : margin_bytes];
  if (!ledger) ledger.reset(new SpaceLedger(margin_bytes < 0 ? -1 : margin_bytes));
  return *ledger;
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
    } catch (const TransferIntegrityError& e) {
      throw TransferIntegrityError(what + ": " + e.what());  // tampering is not retried
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

TransferResult push_attempt(const std::string& host, int port, const std::string& secret, int fd, uint64_t offset,
                            uint64_t size, const std::string& remote_path, const TransferOptions& o,
                            std::vector<uint8_t>& buf) {
  Fd sock = connect_to(host, port, o.connect_timeout_s);
  Channel ch(sock.get(), o.io_timeout_s, -1);
  ch.set_deadline(o.io_timeout_s);
  client_handshake(ch, secret, o.rank, o.peer_rank);
  send_request(ch, kOpPush, remote_path, size);
  Response ready = recv_response(ch);
  if (ready.status != kOk) throw_for_status(ready, "push of " + quoted(remote_path));
  start_data_phase(ch, o);
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
    client_handshake(ch, secret, o.rank, o.peer_rank);
    send_request(ch, kOpFetch, remote_path, 0);
    Response head = recv_response(ch);
    if (head.status != kOk) throw_for_status(head, "fetch of " + quoted(remote_path));
    start_data_phase(ch, o);
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
    std::unique_ptr<TempObject> made;
    try {
      made.reset(new TempObject(base.get(), local_path, size, spares.get(), nullptr,
                                &fetch_ledger(o.space_margin_bytes)));
    } catch (const TransferNoSpaceError& e) {
      try {
        send_response(ch, kNoSpace, 0, e.what());
      } catch (const std::exception&) {
      }
      throw TransferNoSpaceError("fetch of " + quoted(remote_path) + " refused here: " + e.what());
    }
    TempObject& tmp = *made;
    TransferResult r;
    try {
      r.crc32c = receive_object(ch, tmp, size, buf);
    } catch (const TransferIntegrityError& e) {
      try {
        send_response(ch, kIntegrity, 0, e.what());
      } catch (const std::exception&) {
      }
      throw;
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

}  // namespace flashpoint
