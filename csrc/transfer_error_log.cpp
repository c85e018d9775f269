// Bounded, rate-limited error list of the transfer server (see transfer_error_log.hpp).
#include "transfer_error_log.hpp"

#include <cmath>

namespace flashpoint {
namespace xfer {

ErrorLog::ErrorLog(size_t max_kept, size_t burst, double interval_s)
    : max_kept_(max_kept),
      burst_(burst),
      interval_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(interval_s))) {}

void ErrorLog::keep(const std::string& message) {
  entries_.push_back(message);
  while (entries_.size() > max_kept_) {
    entries_.pop_front();
    ++dropped_;
  }
}

void ErrorLog::record(const std::string& message) {
  std::lock_guard<std::mutex> lk(mutex_);
  keep(message);
}

void ErrorLog::record_unauthenticated(const std::string& message) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lk(mutex_);
  if (!window_open_ || now - window_start_ >= interval_) {
    window_open_ = true;
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ < burst_) {
    ++in_window_;
    keep(message);
  } else {
    ++suppressed_;
    ++suppressed_total_;
  }
}

std::vector<std::string> ErrorLog::take() {
  std::lock_guard<std::mutex> lk(mutex_);
  std::vector<std::string> out;
  out.reserve(entries_.size() + 2);
  if (dropped_ > 0) out.push_back(std::to_string(dropped_) + " older error(s) dropped");
  out.insert(out.end(), entries_.begin(), entries_.end());
  if (suppressed_ > 0) {
    const double seconds = std::chrono::duration<double>(interval_).count();
    out.push_back(std::to_string(suppressed_) + " more error(s) about connections that did not authenticate " +
                  "suppressed (at most " + std::to_string(burst_) + " per " +
                  std::to_string(static_cast<long long>(std::lround(seconds))) +
                  " s are listed); stats() counts them (rejected_not_allowed, rejected_peer_cap, " +
                  "handshakes_dropped, handshake_timeouts, auth_failures, protocol_failures)");
  }
  entries_.clear();
  dropped_ = 0;
  suppressed_ = 0;
  return out;
}

uint64_t ErrorLog::suppressed_total() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return suppressed_total_;
}

}  // namespace xfer
}  // namespace flashpoint
