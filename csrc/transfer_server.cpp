// Server side of the transfer service: workers, push and fetch handlers. Accepting and the
// handshakes run in the admission stage (transfer_admission.cpp), one thread, off the workers.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include "transfer.hpp"
#include "transfer_admission.hpp"
#include "transfer_error_log.hpp"
#include "transfer_paths.hpp"
#include "transfer_policy.hpp"
#include "transfer_space.hpp"
#include "transfer_steps.hpp"
#include "transfer_stream.hpp"
#include "transfer_warm.hpp"
#include "transfer_wire.hpp"

namespace flashpoint {

using namespace xfer;

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
  if (!(config_.min_rate_bytes_per_s >= 0) || !std::isfinite(config_.min_rate_bytes_per_s))
    throw std::invalid_argument("min_rate_bytes_per_s must be a finite number >= 0");
  if (config_.rate_grace_s < 0) config_.rate_grace_s = config_.io_timeout_s;
  if (!(config_.rate_grace_s <= 86400)) throw std::invalid_argument("rate_grace_s must be in [0, 86400]");
  if (config_.policy && config_.rank >= config_.policy->world_size())
    throw std::invalid_argument("rank " + std::to_string(config_.rank) + " is not below the policy's world_size " +
                                std::to_string(config_.policy->world_size()));
  if (!(config_.handshake_timeout_s > 0) || config_.handshake_timeout_s > 3600)
    throw std::invalid_argument("handshake_timeout_s must be in (0, 3600]");
  if (config_.max_handshakes < 1 || config_.max_handshakes > 65536)
    throw std::invalid_argument("max_handshakes must be in 1..65536");
  if (config_.max_connections_per_peer < 1 || config_.max_connections_per_peer > 65536)
    throw std::invalid_argument("max_connections_per_peer must be in 1..65536");
  if (!(config_.request_timeout_s > 0) || config_.request_timeout_s > 3600)
    throw std::invalid_argument("request_timeout_s must be in (0, 3600]");
  if (!(config_.queue_timeout_s > 0) || config_.queue_timeout_s > 86400)
    throw std::invalid_argument("queue_timeout_s must be in (0, 86400]");
  if (config_.max_queued_per_rank < 0 || config_.max_queued_per_rank > 65536)
    throw std::invalid_argument("max_queued_per_rank must be in 0..65536");
  if (config_.max_queued_per_rank == 0) config_.max_queued_per_rank = std::max(1, std::min(4, config_.max_pending / 4));
  max_served_per_rank_ = std::max(1, config_.max_connections - 1);
  std::vector<PeerAddress> allowed;
  for (const std::string& a : config_.allowed_peers) allowed.push_back(parse_peer_address(a));

  Fd base = open_base_dir(config_.base_dir);
  mappings_.reset(new WarmMappingCache());
  space_.reset(new SpaceLedger(config_.space_margin_bytes));
  expected_.reset(new ExpectedSizes());
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
  if (::listen(listener.get(), 1024) != 0) throw OsError(errno, "listen failed", "");
  struct sockaddr_storage bound;
  socklen_t blen = sizeof(bound);
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  Fd stop_event(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (stop_event.get() < 0) throw OsError(errno, "eventfd failed", "");

  // Temporary files of receptions that died with their process (flock released) are removed.
  const size_t swept = sweep_stale_temp_files(base.get());
  temp_files_swept_.store(swept);
  base_fd_ = base.release();
  listen_fd_ = listener.release();
  stop_fd_ = stop_event.release();
  errors_.reset(new ErrorLog());
  AdmissionLimits limits;
  limits.handshake_timeout_s = config_.handshake_timeout_s;
  limits.request_timeout_s = config_.request_timeout_s;
  limits.max_handshakes = config_.max_handshakes;
  limits.max_per_peer = config_.max_connections_per_peer;
  // The stage proves this server's rank and admits only ranks of the job (below the policy's world size).
  const uint32_t rank_limit = config_.policy ? config_.policy->world_size() : 0;
  admission_.reset(new Admission(listen_fd_, stop_fd_, config_.secret, config_.rank, rank_limit, limits, *errors_));
  admission_->set_allowed(config_.allow_any_peer, allowed);
  try {
    for (int i = 0; i < config_.max_connections; ++i) workers_.emplace_back([this] { worker_loop(); });
    accept_thread_ = std::thread([this] {
      // Every second at least: a kept mapping must not pin a deleted file.
      admission_->run([this](Admitted& a) { return hand_over(a); }, [this] { mappings_->drop_deleted(); });
    });
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
  for (auto& p : queue_) {
    ::close(p->fd);
    admission_->release(p->address);
  }
  queue_.clear();
  mappings_->clear();
  ::close(listen_fd_);
  ::close(stop_fd_);
  ::close(base_fd_);
  listen_fd_ = stop_fd_ = base_fd_ = -1;
  stopped_.store(true);
}

std::vector<std::string> TransferServer::take_errors() { return errors_->take(); }

std::map<std::string, uint64_t> TransferServer::stats() const {
  const AdmissionCounters& a = admission_->counters();
  return {{"accepted", a.accepted.load()},
          {"rejected_not_allowed", a.rejected_not_allowed.load()},
          {"rejected_peer_cap", a.rejected_peer_cap.load()},
          {"handshakes_dropped", a.handshakes_dropped.load()},
          {"handshake_timeouts", a.handshake_timeouts.load()},
          {"handshakes_ok", a.handshakes_ok.load()},
          {"handshaking", a.handshaking.load()},
          {"errors_suppressed", errors_->suppressed_total()},
          {"rejected_busy", rejected_busy_.load()},
          {"rejected_rank_cap", rejected_rank_cap_.load()},
          {"request_timeouts", a.request_timeouts.load()},
          {"queue_timeouts", queue_timeouts_.load()},
          {"auth_failures", a.auth_failures.load()},
          {"protocol_failures", a.protocol_failures.load() + protocol_failures_.load()},
          {"integrity_failures", a.integrity_failures.load() + integrity_failures_.load()},
          {"pushes_ok", pushes_ok_.load()},
          {"fetches_ok", fetches_ok_.load()},
          {"transfer_failures", transfer_failures_.load()},
          {"bytes_received", bytes_received_.load()},
          {"bytes_sent", bytes_sent_.load()},
          {"spares_taken", spares_taken_.load()},
          {"mappings_reused", mappings_reused_.load()},
          {"temp_files_swept", temp_files_swept_.load()},
          {"forbidden", forbidden_.load()},
          {"no_space", no_space_.load()},
          {"too_slow", too_slow_.load()}};
}

void TransferServer::expect_sizes(uint64_t step, std::map<std::string, uint64_t> sizes) {
  expected_->expect(step, std::move(sizes));
}

void TransferServer::start_rate_floor(Channel& ch) const {
  ch.start_rate_floor(config_.min_rate_bytes_per_s, config_.rate_grace_s);
}

void TransferServer::set_allowed_peers(bool any, const std::vector<std::string>& addresses) {
  std::vector<PeerAddress> parsed;
  for (const std::string& a : addresses) parsed.push_back(parse_peer_address(a));
  admission_->set_allowed(any, parsed);
}

std::pair<bool, std::vector<std::string>> TransferServer::allowed_peers() const { return admission_->allowed(); }

void TransferServer::record_error(const std::string& message) { errors_->record(message); }

// From the admission thread: an authenticated request joins the queue, or is refused when its
// rank has max_queued_per_rank waiting already, or the queue is full. (Only waiting ones count:
// a rank that pushes one object after the other may send its next request while a worker still
// finishes its last.)
bool TransferServer::hand_over(Admitted& admitted) {
  std::vector<std::unique_ptr<Admitted>> expired;
  std::string refusal;
  {
    std::lock_guard<std::mutex> lk(queue_mutex_);
    if (stopping_) return false;  // closed without a word, like every connection at stop()
    take_expired(&expired);  // their places go to new requests
    int& queued = rank_queued_[admitted.rank];
    if (queued >= config_.max_queued_per_rank) {
      rejected_rank_cap_.fetch_add(1);
      refusal = std::to_string(queued) + " requests of rank " + std::to_string(admitted.rank) +
                " are waiting already (max_queued_per_rank " + std::to_string(config_.max_queued_per_rank) + ")";
    } else if (queue_.size() >= static_cast<size_t>(config_.max_pending)) {
      rejected_busy_.fetch_add(1);
      refusal = "server busy (" + std::to_string(config_.max_pending) + " requests already waiting)";
    } else {
      ++queued;
      admitted.queued_at = Clock::now();
      queue_.emplace_back(new Admitted(std::move(admitted)));
    }
    if (queued == 0) rank_queued_.erase(admitted.rank);
  }
  queue_cv_.notify_all();
  close_expired(expired);
  if (refusal.empty()) return true;
  record_error("peer " + admitted.peer + " (rank " + std::to_string(admitted.rank) +
               "): connection closed unserved after its request: " + refusal);
  return false;
}

void TransferServer::take_expired(std::vector<std::unique_ptr<Admitted>>* expired) {
  const auto now = Clock::now();
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(config_.queue_timeout_s));
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (now - (*it)->queued_at <= limit) {
      ++it;
      continue;
    }
    if (--rank_queued_[(*it)->rank] <= 0) rank_queued_.erase((*it)->rank);
    expired->push_back(std::move(*it));
    it = queue_.erase(it);
  }
}

std::unique_ptr<Admitted> TransferServer::next_request() {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const auto served = rank_served_.find((*it)->rank);
    if (served != rank_served_.end() && served->second >= max_served_per_rank_) continue;
    std::unique_ptr<Admitted> next = std::move(*it);
    queue_.erase(it);
    if (--rank_queued_[next->rank] <= 0) rank_queued_.erase(next->rank);
    return next;
  }
  return nullptr;
}

void TransferServer::close_expired(std::vector<std::unique_ptr<Admitted>>& expired) {
  for (auto& e : expired) {
    queue_timeouts_.fetch_add(1);
    ::close(e->fd);
    admission_->release(e->address);
    record_error("peer " + e->peer + " (rank " + std::to_string(e->rank) + "): request closed unserved after " +
                 "waiting queue_timeout_s = " + std::to_string(config_.queue_timeout_s) + " s for a worker");
  }
  expired.clear();
}

void TransferServer::worker_loop() {
  for (;;) {
    std::unique_ptr<Admitted> p;
    std::vector<std::unique_ptr<Admitted>> expired;
    {
      std::unique_lock<std::mutex> lk(queue_mutex_);
      for (;;) {
        if (stopping_) return;  // stop() closes what is still queued
        take_expired(&expired);
        p = next_request();
        if (p || !expired.empty()) break;
        // A request waiting for its rank's turn wakes at the latest when it would expire.
        if (queue_.empty()) queue_cv_.wait(lk);
        else queue_cv_.wait_for(lk, std::chrono::duration<double>(config_.queue_timeout_s));
      }
      if (p) ++rank_served_[p->rank];
    }
    close_expired(expired);
    if (!p) continue;
    {
      Fd conn(p->fd);
      try {
        handle(conn.get(), *p);
      } catch (const std::exception& e) {
        record_error("peer " + p->peer + ": " + e.what());
      } catch (...) {
        record_error("peer " + p->peer + ": unknown error");
      }
    }
    {
      std::lock_guard<std::mutex> lk(queue_mutex_);
      if (--rank_served_[p->rank] <= 0) rank_served_.erase(p->rank);
    }
    queue_cv_.notify_all();  // a request of this rank may now take a worker
    admission_->release(p->address);  // after the close: the address may open another connection
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
  if (dynamic_cast<const TransferNoSpaceError*>(&e)) return {kNoSpace, e.what()};
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

void TransferServer::handle(int fd, Admitted& admitted) {
  const std::string& peer = admitted.peer;
  Channel ch(fd, config_.io_timeout_s, stop_fd_);
  // The first response, from being taken up here (the request came whole, its tag checked, in the admission stage).
  ch.set_deadline(config_.io_timeout_s);
  ch.start_session(std::move(admitted.session));
  const uint32_t client_rank = admitted.rank;  // proved in the handshake; every policy check below uses it
  const uint8_t* req = admitted.request;
  const uint32_t op = get_u32(req);
  const uint64_t size = get_u64(req + 8);
  const std::string& path = admitted.path;
  std::string bad;
  if (op != kOpPush && op != kOpFetch) bad = "unknown operation " + std::to_string(op);
  else if (get_u32(req + 16) != 0 || get_u32(req + 20) != 0) bad = "non-zero reserved request fields";
  else if (op == kOpFetch && size != 0) bad = "fetch request with a non-zero size";
  if (!bad.empty()) {
    protocol_failures_.fetch_add(1);
    record_error("peer " + peer + " (rank " + std::to_string(client_rank) + "): bad request: " + bad);
    try {
      send_response(ch, kBadRequest, 0, bad);
      drain_briefly(fd, stop_fd_);
    } catch (const std::exception&) {
    }
    return;
  }

  const std::string who = peer + " (rank " + std::to_string(client_rank) + ")";
  const Connection conn{ch, fd, who, std::string(op == kOpPush ? "push" : "fetch") + " of " + quoted(path),
                        client_rank};
  if (op == kOpPush) handle_push(conn, path, size);
  else handle_fetch(conn, path);
}

void TransferServer::refuse(const Connection& c, uint32_t status, const std::string& message) {
  transfer_failures_.fetch_add(1);
  record_error("peer " + c.peer + ": " + c.what + " refused (" + status_name(status) + "): " + message);
  try {
    send_response(c.ch, status, 0, message);
    drain_briefly(c.fd, stop_fd_);
  } catch (const std::exception&) {
  }
}

// PUSH: a temporary file (from a spare when one fits), "ready", the data + trailer, checks,
// rename into place, "stored".
void TransferServer::handle_push(const Connection& c, const std::string& path, uint64_t size) {
  Channel& ch = c.ch;
  const std::string& peer = c.peer;
  const std::string& what = c.what;
  auto refuse = [&](uint32_t status, const std::string& message) { this->refuse(c, status, message); };
  std::vector<uint8_t> buf(kChunkBytes);
  // Authorization first: nothing touches the disk for a path this rank may not push.
  PolicyPath parsed;
  if (config_.policy) {
    const std::string why = config_.policy->refuse_push(c.rank, path, &parsed);
    if (!why.empty()) {
      forbidden_.fetch_add(1);
      refuse(kForbidden, why);
      return;
    }
  }
  if (size > config_.max_object_bytes) {
    refuse(kTooLarge, "object size " + std::to_string(size) + " exceeds max_object_bytes " +
                          std::to_string(config_.max_object_bytes));
    return;
  }
  const std::string unexpected = expected_->refuse(path, config_.policy != nullptr, parsed.step, size);
  if (!unexpected.empty()) {
    forbidden_.fetch_add(1);
    refuse(kForbidden, unexpected);
    return;
  }
  if (config_.policy) {  // only into a version this node saved itself; growth bounded without a commit record
    const size_t slash = path.find('/');  // the policy parsed it: <version dir>/<object>
    bool too_large = false;
    const std::string why = refuse_push_into_version(base_fd_, *config_.policy, path.substr(0, slash),
                                                     path.substr(slash + 1), parsed.step, size,
                                                     expected_->lists(path), &too_large);
    if (!why.empty()) {
      forbidden_.fetch_add(1);
      refuse(too_large ? kTooLarge : kForbidden, why);
      return;
    }
  }
  std::unique_ptr<TempObject> tmp;
  try {
    Fd spares = open_spare_dir(base_fd_, config_.spare_dir);
    tmp.reset(new TempObject(base_fd_, path, size, spares.get(), mappings_.get(), space_.get()));
    if (tmp->from_spare()) spares_taken_.fetch_add(1);
  } catch (const std::exception& e) {
    const Refusal r = refusal_for(e);
    if (r.status == kNoSpace) no_space_.fetch_add(1);
    refuse(r.status == kNotFound ? kIoError : r.status, r.message);
    return;
  }
  try {
    send_response(ch, kOk, 0, "ready");
    ch.clear_deadline();
    start_rate_floor(ch);
    try {
      receive_object(ch, *tmp, size, buf);
    } catch (const TransferIntegrityError& e) {
      tmp.reset();  // the temporary file is gone before the sender hears about it
      integrity_failures_.fetch_add(1);
      refuse(kIntegrity, std::string(e.what()));
      return;
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
    if (ch.fell_below_rate()) too_slow_.fetch_add(1);
    record_error("peer " + peer + ": " + what + " failed: " + e.what() + " (nothing stored)");
  }
}

// FETCH: "sending" with the size, the data + trailer, then the client's verdict (for the log).
void TransferServer::handle_fetch(const Connection& c, const std::string& path) {
  Channel& ch = c.ch;
  const std::string& peer = c.peer;
  const std::string& what = c.what;
  auto refuse = [&](uint32_t status, const std::string& message) { this->refuse(c, status, message); };
  std::vector<uint8_t> buf(kChunkBytes);
  if (config_.policy) {
    const std::string why = config_.policy->refuse_fetch(c.rank, path);
    if (!why.empty()) {
      forbidden_.fetch_add(1);
      refuse(kForbidden, why);
      return;
    }
  }
  Fd file;
  uint64_t file_size = 0;
  try {
    file = open_confined_for_read(base_fd_, path, &file_size, /*refuse_hard_links=*/true);
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
    start_rate_floor(ch);
    const uint32_t crc = send_object(ch, file.get(), 0, file_size, /*zero_copy=*/false, buf);
    send_trailer(ch, file_size, crc);
    bytes_sent_.fetch_add(file_size);
    const Response ack = recv_response(ch);  // TransferIntegrityError when forged
    if (ack.status != kOk) {
      transfer_failures_.fetch_add(1);
      record_error("peer " + peer + ": " + what + ": the client reported " + status_name(ack.status) + ": " + ack.message);
      return;
    }
    fetches_ok_.fetch_add(1);
  } catch (const std::exception& e) {
    transfer_failures_.fetch_add(1);
    if (ch.fell_below_rate()) too_slow_.fetch_add(1);
    record_error("peer " + peer + ": " + what + " failed: " + e.what());
  }
}

}  // namespace flashpoint
