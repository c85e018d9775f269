// Admission stage of the transfer server (see transfer_admission.hpp).
#include "transfer_admission.hpp"

#include <sys/epoll.h>

#include "transfer_error_log.hpp"

namespace flashpoint {
namespace xfer {

namespace {

constexpr uint64_t kListenerId = 0;
constexpr uint64_t kStopId = 1;
constexpr int kAcceptBatch = 64;      // accepts per loop turn, so handshakes in progress are never starved
constexpr int kEvents = 64;
constexpr auto kTick = std::chrono::seconds(1);
constexpr auto kAcceptPause = std::chrono::milliseconds(100);  // after EMFILE and friends
constexpr auto kDrainTime = std::chrono::milliseconds(200);    // reading after an answer, before the close

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", s);
  return buf;
}

// The address and "host:port" of an accepted peer; false for a family that is not IP.
bool address_of(const sockaddr_storage& ss, PeerAddress* address, std::string* name) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    address->bytes.fill(0);
    address->bytes[10] = address->bytes[11] = 0xff;
    std::memcpy(address->bytes.data() + 12, &a->sin_addr, 4);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    std::memcpy(address->bytes.data(), &a->sin6_addr, 16);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  } else {
    return false;
  }
  *name = std::string(host) + ":" + std::to_string(port);
  return true;
}

// Adds fd to the epoll set (EPOLL_CTL_ADD) or changes its events (EPOLL_CTL_MOD), under id.
bool epoll_watch(int epoll_fd, int op, int fd, uint64_t id, uint32_t events) {
  struct epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = events;
  ev.data.u64 = id;
  return ::epoll_ctl(epoll_fd, op, fd, &ev) == 0;
}

bool is_v4_mapped(const PeerAddress& a) {
  for (int i = 0; i < 10; ++i)
    if (a.bytes[i] != 0) return false;
  return a.bytes[10] == 0xff && a.bytes[11] == 0xff;
}

}  // namespace

PeerAddress parse_peer_address(const std::string& text) {
  PeerAddress out;
  const bool clean = text.find('\0') == std::string::npos;  // inet_pton would stop at a NUL and accept the rest
  struct in_addr v4;
  if (clean && ::inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    out.bytes[10] = out.bytes[11] = 0xff;
    std::memcpy(out.bytes.data() + 12, &v4, 4);
    return out;
  }
  const std::string host = text.substr(0, text.find('%'));  // an IPv6 zone names an interface, not a peer
  struct in6_addr v6;
  if (clean && ::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    std::memcpy(out.bytes.data(), &v6, 16);
    return out;
  }
  throw std::invalid_argument("not a numeric IPv4 or IPv6 address: " + quoted(text) +
                              " (resolve host names before passing them as allowed peers)");
}

std::string address_text(const PeerAddress& address) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (is_v4_mapped(address)) ::inet_ntop(AF_INET, address.bytes.data() + 12, buf, sizeof(buf));
  else ::inet_ntop(AF_INET6, address.bytes.data(), buf, sizeof(buf));
  return buf;
}

// One connection in the stage: the bytes of the message being received or sent, the
// cryptographic state between the hellos and the proof, then the session and the request.
struct Admission::Handshake {
  // kRefuse: telling another version ours, then close. kRequest: receiving the request's fixed
  // fields (in) then its path and tag (body). kDrain: answered and shut down, reading what the
  // peer still sends until it closes or the deadline, so the close does not reset the answer.
  enum Phase { kHello, kReply, kProof, kRefuse, kRequest, kDrain };
  uint64_t id = 0;
  int fd = -1;
  PeerAddress address;
  std::string peer;
  Clock::time_point deadline;
  std::multimap<Clock::time_point, uint64_t>::iterator deadline_at;
  Phase phase = kHello;
  bool wants_out = false;  // registered for EPOLLOUT (the server hello did not fit at once)
  uint8_t in[kClientHelloBytes];
  size_t got = 0;
  uint8_t out[kServerHelloBytes];
  size_t sent = 0;
  std::string refusal;
  ServerHandshake hs;
  uint32_t rank = 0;                 // once proved
  std::unique_ptr<Session> session;  // once proved
  std::string body;                  // the request's path and tag
  size_t body_got = 0;
};

Admission::Admission(int listen_fd, int stop_fd, const std::string& secret, uint32_t server_rank, uint32_t rank_limit,
                     const AdmissionLimits& limits, ErrorLog& log)
    : listen_fd_(listen_fd),
      stop_fd_(stop_fd),
      secret_(secret),
      server_rank_(server_rank),
      rank_limit_(rank_limit),
      limits_(limits),
      log_(log) {}

Admission::~Admission() {
  for (Handshake& h : handshakes_) ::close(h.fd);
}

void Admission::set_allowed(bool any, const std::vector<PeerAddress>& addresses) {
  std::vector<PeerAddress> sorted(addresses);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::lock_guard<std::mutex> lk(allow_mutex_);
  allow_any_ = any;
  allowed_.swap(sorted);
}

std::pair<bool, std::vector<std::string>> Admission::allowed() const {
  std::lock_guard<std::mutex> lk(allow_mutex_);
  std::vector<std::string> texts;
  for (const PeerAddress& a : allowed_) texts.push_back(address_text(a));
  return {allow_any_, texts};
}

bool Admission::is_allowed(const PeerAddress& address) const {
  std::lock_guard<std::mutex> lk(allow_mutex_);
  return allow_any_ || std::binary_search(allowed_.begin(), allowed_.end(), address);
}

void Admission::unuse(const PeerAddress& address, bool was_handshaking) {
  std::lock_guard<std::mutex> lk(use_mutex_);
  auto f = use_.find(address);
  if (f == use_.end()) return;
  if (was_handshaking) --f->second.handshaking;
  if (--f->second.open <= 0) use_.erase(f);
}

void Admission::release(const PeerAddress& address) { unuse(address, false); }

void Admission::set_deadline(Handshake& h, Clock::time_point deadline) {
  if (h.deadline_at != deadlines_.end()) deadlines_.erase(h.deadline_at);
  h.deadline = deadline;
  h.deadline_at = deadlines_.emplace(deadline, h.id);
}

void Admission::forget(Handshakes::iterator it) {
  const int fd = it->fd;
  unuse(it->address, true);
  deadlines_.erase(it->deadline_at);
  by_id_.erase(it->id);
  handshakes_.erase(it);
  counters_.handshaking.store(handshakes_.size());
  ::close(fd);  // last, so whoever sees the close sees it counted; also leaves the epoll set
}

void Admission::drop(Handshakes::iterator it, const std::string& why) {
  if (it->session) log_.record("peer " + it->peer + " (rank " + std::to_string(it->rank) + "): " + why);
  else log_.record_unauthenticated("peer " + it->peer + ": " + why);
  forget(it);
}

Admission::Handshakes::iterator Admission::oldest_of(const PeerAddress& address) {
  for (auto it = handshakes_.begin(); it != handshakes_.end(); ++it)
    if (it->address == address) return it;
  return handshakes_.end();
}

// The oldest handshake of the address with the most handshakes in the stage: a flood from some
// addresses displaces its own connections before anyone else's.
Admission::Handshakes::iterator Admission::victim_for_room() {
  std::lock_guard<std::mutex> lk(use_mutex_);
  int most = 0;
  for (const auto& kv : use_) most = std::max(most, kv.second.handshaking);
  for (auto it = handshakes_.begin(); it != handshakes_.end(); ++it) {
    auto f = use_.find(it->address);
    if (f != use_.end() && f->second.handshaking == most) return it;
  }
  return handshakes_.begin();
}

void Admission::admit(int epoll_fd, int fd, const sockaddr_storage& ss, Clock::time_point now) {
  counters_.accepted.fetch_add(1);
  PeerAddress address;
  std::string name;
  // Counters move before the close: whoever sees the close sees them counted.
  if (!address_of(ss, &address, &name)) {
    counters_.protocol_failures.fetch_add(1);
    ::close(fd);
    log_.record_unauthenticated("a connection that is not IPv4 or IPv6 was refused");
    return;
  }
  if (!is_allowed(address)) {
    counters_.rejected_not_allowed.fetch_add(1);
    ::close(fd);  // before reading or writing a byte
    log_.record_unauthenticated("peer " + name + ": connection refused: " + address_text(address) +
                                " is not one of the job's peer addresses");
    return;
  }
  bool displace_own = false;
  {
    std::lock_guard<std::mutex> lk(use_mutex_);
    const auto f = use_.find(address);
    if (f != use_.end() && f->second.open >= limits_.max_per_peer) {
      const Use& u = f->second;
      if (u.handshaking == 0) {
        counters_.rejected_peer_cap.fetch_add(1);
        ::close(fd);
        log_.record_unauthenticated("peer " + name + ": connection refused: " + std::to_string(u.open) +
                                    " authenticated connections from " + address_text(address) +
                                    " already (max_connections_per_peer)");
        return;
      }
      displace_own = true;
    }
  }
  const auto own = displace_own ? oldest_of(address) : handshakes_.end();
  if (own != handshakes_.end()) {
    counters_.handshakes_dropped.fetch_add(1);
    drop(own, "handshake dropped for a newer connection from the same address (" +
                  std::to_string(limits_.max_per_peer) + " per address, max_connections_per_peer)");
  }
  if (handshakes_.size() >= static_cast<size_t>(limits_.max_handshakes)) {
    counters_.handshakes_dropped.fetch_add(1);
    drop(victim_for_room(), "handshake dropped: " + std::to_string(limits_.max_handshakes) +
                                " connections were handshaking (max_handshakes); this address had the most");
  }
  set_socket_options(fd);
  Handshake h;
  h.id = next_id_++;
  h.fd = fd;
  h.address = address;
  h.peer = name;
  h.deadline_at = deadlines_.end();
  if (!epoll_watch(epoll_fd, EPOLL_CTL_ADD, fd, h.id, EPOLLIN)) {
    const int err = errno;
    ::close(fd);
    log_.record_unauthenticated("peer " + name + ": connection dropped: epoll_ctl failed: " + errno_text(err));
    return;
  }
  {
    std::lock_guard<std::mutex> lk(use_mutex_);
    Use& u = use_[address];
    ++u.open;
    ++u.handshaking;
  }
  handshakes_.push_back(std::move(h));
  by_id_[handshakes_.back().id] = std::prev(handshakes_.end());
  set_deadline(handshakes_.back(), now + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(limits_.handshake_timeout_s)));
  counters_.handshaking.store(handshakes_.size());
}

bool Admission::accept_some(int epoll_fd, Clock::time_point now) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    struct sockaddr_storage peer;
    socklen_t plen = sizeof(peer);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &plen, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      admit(epoll_fd, fd, peer, now);
      continue;
    }
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return true;
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    log_.record_unauthenticated(std::string("accept failed: ") + errno_text(err));
    return !(err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM);
  }
  return true;
}

void Admission::progress(int epoll_fd, Handshakes::iterator it, const std::function<bool(Admitted&)>& hand_over) {
  Handshake& h = *it;
  if (h.phase == Handshake::kDrain) {
    char sink[4096];
    for (;;) {
      const ssize_t r = ::recv(h.fd, sink, sizeof(sink), 0);
      if (r > 0) continue;
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      forget(it);  // the peer closed (or reset): the answer went out
      return;
    }
  }
  if (h.phase == Handshake::kRequest) {
    bool whole = false;
    try {
      whole = receive_request(it);
    } catch (const TransferIntegrityError& e) {
      refuse_integrity(epoll_fd, it, e.what());
      return;
    } catch (const std::exception& e) {
      counters_.protocol_failures.fetch_add(1);
      drop(it, std::string("reading the request failed: ") + e.what());
      return;
    }
    if (!whole) return;
    Admitted admitted;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, h.fd, nullptr);  // the worker owns the socket from here on
    admitted.fd = h.fd;
    admitted.address = h.address;
    admitted.peer = h.peer;
    admitted.rank = h.rank;
    admitted.session = std::move(h.session);
    std::memcpy(admitted.request, h.in, kRequestBytes);
    admitted.path = h.body.substr(0, h.body.size() - kTagBytes);
    {
      std::lock_guard<std::mutex> lk(use_mutex_);
      --use_[h.address].handshaking;  // still open: counted until the worker releases it
    }
    deadlines_.erase(h.deadline_at);
    by_id_.erase(h.id);
    handshakes_.erase(it);
    counters_.handshaking.store(handshakes_.size());
    const PeerAddress address = admitted.address;
    const int fd = admitted.fd;
    if (!hand_over(admitted)) {
      ::close(fd);
      unuse(address, false);
    }
    return;
  }
  for (;;) {
    if (h.phase == Handshake::kReply || h.phase == Handshake::kRefuse) {
      const ssize_t r = ::send(h.fd, h.out + h.sent, kServerHelloBytes - h.sent, MSG_NOSIGNAL);
      if (r < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) {
          if (!h.wants_out) h.wants_out = epoll_watch(epoll_fd, EPOLL_CTL_MOD, h.fd, h.id, EPOLLOUT);
          return;
        }
        counters_.protocol_failures.fetch_add(1);
        drop(it, std::string("handshake failed: sending the server hello failed: ") + errno_text(err));
        return;
      }
      h.sent += static_cast<size_t>(r);
      if (h.sent < kServerHelloBytes) continue;
      if (h.phase == Handshake::kRefuse) {
        counters_.protocol_failures.fetch_add(1);
        drop(it, "handshake failed: " + h.refusal);
        return;
      }
      if (h.wants_out) h.wants_out = !epoll_watch(epoll_fd, EPOLL_CTL_MOD, h.fd, h.id, EPOLLIN);
      h.phase = Handshake::kProof;
      h.got = 0;
      continue;  // the proof may be there already
    }

    const bool hello = h.phase == Handshake::kHello;
    const size_t need = hello ? kClientHelloBytes : kMacBytes;
    const char* what = hello ? "client hello" : "client proof";
    const ssize_t r = ::recv(h.fd, h.in + h.got, need - h.got, 0);
    if (r == 0) {
      counters_.protocol_failures.fetch_add(1);
      drop(it, "handshake failed: connection closed by the peer after " + std::to_string(h.got) + " of " +
                   std::to_string(need) + " bytes of " + what);
      return;
    }
    if (r < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      counters_.protocol_failures.fetch_add(1);
      drop(it, std::string("handshake failed: receiving the ") + what + " failed: " + errno_text(err));
      return;
    }
    h.got += static_cast<size_t>(r);
    if (h.got < need) continue;

    if (hello) {
      try {
        h.hs.answer(secret_, server_rank_, h.in, h.out);
        h.phase = Handshake::kReply;
      } catch (const VersionMismatchError& e) {
        h.phase = Handshake::kRefuse;
        h.refusal = e.what();
      } catch (const std::exception& e) {
        counters_.protocol_failures.fetch_add(1);
        drop(it, std::string("handshake failed: ") + e.what());
        return;
      }
      h.sent = 0;
      continue;
    }

    try {
      h.session = h.hs.finish(secret_, rank_limit_, h.in);
      h.rank = h.hs.client_rank();
    } catch (const TransferAuthError& e) {
      counters_.auth_failures.fetch_add(1);
      drop(it, e.what());
      return;
    } catch (const std::exception& e) {
      counters_.protocol_failures.fetch_add(1);
      drop(it, std::string("handshake failed: ") + e.what());
      return;
    }
    counters_.handshakes_ok.fetch_add(1);
    // The request follows at once from a real client: it gets request_timeout_s, not more.
    h.phase = Handshake::kRequest;
    h.got = 0;
    set_deadline(h, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(limits_.request_timeout_s)));
    progress(epoll_fd, it, hand_over);  // the request may be there already
    return;
  }
}

bool Admission::receive_request(Handshakes::iterator it) {
  Handshake& h = *it;
  while (h.got < kRequestBytes) {
    const ssize_t r = ::recv(h.fd, h.in + h.got, kRequestBytes - h.got, 0);
    if (r == 0) throw TransferError("connection closed by the peer after " + std::to_string(h.got) + " of " +
                                    std::to_string(kRequestBytes) + " bytes of the request");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      throw TransferError(std::string("receiving the request failed: ") + errno_text(errno));
    }
    h.got += static_cast<size_t>(r);
    if (h.got < kRequestBytes) continue;
    // The path length only says where the tag is; nothing else of the request is read before the
    // tag checked out. A length no client sends cannot be authenticated at all.
    const uint32_t path_len = get_u32(h.in + 4);
    if (path_len == 0 || path_len > kTransferMaxPathBytes)
      throw TransferIntegrityError("request with a path length of " + std::to_string(path_len) + " (outside 1.." +
                                   std::to_string(kTransferMaxPathBytes) +
                                   "): it cannot be authenticated; the connection was tampered with or corrupted");
    h.body.assign(path_len + kTagBytes, '\0');
    h.body_got = 0;
  }
  while (h.body_got < h.body.size()) {
    const ssize_t r = ::recv(h.fd, &h.body[h.body_got], h.body.size() - h.body_got, 0);
    if (r == 0) throw TransferError("connection closed by the peer after " + std::to_string(h.body_got) + " of " +
                                    std::to_string(h.body.size()) + " bytes of the request's path and tag");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      throw TransferError(std::string("receiving the request failed: ") + errno_text(errno));
    }
    h.body_got += static_cast<size_t>(r);
  }
  const size_t path_len = h.body.size() - kTagBytes;
  KeyedMac& mac = h.session->start_recv(kFrameRequest);
  mac.update(h.in, kRequestBytes);
  mac.update(h.body.data(), path_len);
  h.session->verify(mac, reinterpret_cast<const uint8_t*>(h.body.data()) + path_len, "request");
  return true;
}

void Admission::refuse_integrity(int epoll_fd, Handshakes::iterator it, const std::string& why) {
  Handshake& h = *it;
  counters_.integrity_failures.fetch_add(1);
  log_.record("peer " + h.peer + " (rank " + std::to_string(h.rank) + "): " + why);
  try {
    // A fresh connection's send buffer holds these few bytes at once; the short timeout only
    // bounds the unthinkable, so the stage never waits on one peer.
    Channel ch(h.fd, 0.05, -1);
    ch.start_session(std::move(h.session));
    send_response(ch, kIntegrity, 0, why);
  } catch (const std::exception&) {
  }
  ::shutdown(h.fd, SHUT_WR);
  h.phase = Handshake::kDrain;
  if (h.wants_out) h.wants_out = !epoll_watch(epoll_fd, EPOLL_CTL_MOD, h.fd, h.id, EPOLLIN);
  set_deadline(h, Clock::now() + kDrainTime);
}

void Admission::timed_out(int epoll_fd, Handshakes::iterator it) {
  Handshake& h = *it;
  if (h.phase == Handshake::kDrain) {
    forget(it);
    return;
  }
  if (h.phase == Handshake::kRequest) {
    counters_.request_timeouts.fetch_add(1);
    const std::string budget = "request_timeout_s = " + seconds_text(limits_.request_timeout_s) + " s";
    if (h.got < kRequestBytes) {
      drop(it, "no request within " + budget + " of the handshake (" + std::to_string(h.got) + " of " +
                   std::to_string(kRequestBytes) + " bytes received); connection closed");
      return;
    }
    // Its fixed fields came, the rest did not: a path length altered on the way (or a client that
    // stalled mid-message, which a real one does not do). It cannot be authenticated.
    refuse_integrity(epoll_fd, it, "the request did not arrive whole within " + budget + " (" +
                                       std::to_string(h.body_got) + " of " + std::to_string(h.body.size()) +
                                       " bytes of its path and tag): its length was tampered with or corrupted");
    return;
  }
  counters_.handshake_timeouts.fetch_add(1);
  const size_t need = h.phase == Handshake::kHello ? kClientHelloBytes : h.phase == Handshake::kProof ? kMacBytes : 0;
  const std::string where = h.phase == Handshake::kHello   ? "of the client hello"
                            : h.phase == Handshake::kProof ? "of the client proof"
                                                           : "";
  const std::string detail = need ? std::to_string(h.got) + " of " + std::to_string(need) + " bytes " + where +
                                        " received"
                                  : std::string("the server hello not yet taken by the peer");
  drop(it, "handshake timed out: not completed within handshake_timeout_s = " +
               seconds_text(limits_.handshake_timeout_s) + " s of its connection (" + detail + ")");
}

void Admission::run(const std::function<bool(Admitted&)>& hand_over, const std::function<void()>& every_second) {
  Fd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (epoll.get() < 0) {
    log_.record(std::string("admission: epoll_create1 failed, no connection is accepted: ") + errno_text(errno));
    return;
  }
  if (!epoll_watch(epoll.get(), EPOLL_CTL_ADD, stop_fd_, kStopId, EPOLLIN) ||
      !epoll_watch(epoll.get(), EPOLL_CTL_ADD, listen_fd_, kListenerId, EPOLLIN)) {
    log_.record(std::string("admission: epoll_ctl failed, no connection is accepted: ") + errno_text(errno));
    return;
  }
  struct epoll_event events[kEvents];
  Clock::time_point next_tick = Clock::now() + kTick;
  bool paused = false;
  Clock::time_point resume;
  for (;;) {
    Clock::time_point wake = next_tick;
    if (!deadlines_.empty()) wake = std::min(wake, deadlines_.begin()->first);
    if (paused) wake = std::min(wake, resume);
    const double wait_s = std::chrono::duration<double>(wake - Clock::now()).count();
    const int n = ::epoll_wait(epoll.get(), events, kEvents, wait_s > 0 ? timeout_ms(wait_s) : 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      log_.record(std::string("admission: epoll_wait failed, no connection is accepted any more: ") +
                  errno_text(errno));
      break;
    }
    bool stopping = false, listener_ready = false;
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kStopId) stopping = true;
      if (events[i].data.u64 == kListenerId) listener_ready = true;
    }
    if (stopping) break;
    for (int i = 0; i < n; ++i) {  // handshakes in progress first: a burst of accepts must not starve them
      const auto f = by_id_.find(events[i].data.u64);
      if (f != by_id_.end()) progress(epoll.get(), f->second, hand_over);
    }
    Clock::time_point now = Clock::now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const auto f = by_id_.find(deadlines_.begin()->second);
      if (f == by_id_.end()) {  // cannot happen: every entry leaves with its connection
        deadlines_.erase(deadlines_.begin());
        continue;
      }
      timed_out(epoll.get(), f->second);
    }
    if (paused && now >= resume) {
      epoll_watch(epoll.get(), EPOLL_CTL_MOD, listen_fd_, kListenerId, EPOLLIN);
      paused = false;
    }
    if (listener_ready && !paused && !accept_some(epoll.get(), now)) {
      // Level-triggered: a full descriptor table would wake every turn until it frees up.
      epoll_watch(epoll.get(), EPOLL_CTL_MOD, listen_fd_, kListenerId, 0);
      paused = true;
      resume = now + kAcceptPause;
    }
    if (now >= next_tick) {
      every_second();
      next_tick = now + kTick;
    }
  }
  while (!handshakes_.empty()) {  // stopping: closed without a word, not logged
    ::close(handshakes_.front().fd);
    unuse(handshakes_.front().address, true);
    handshakes_.pop_front();
  }
  by_id_.clear();
  deadlines_.clear();
  counters_.handshaking.store(0);
}

}  // namespace xfer
}  // namespace flashpoint
