// The transfer server's error list (TransferServer::take_errors, Python errors()): bounded in
// entries, and rate-limited for connections that never authenticated, so that a flood of them
// (a port scanner, a stuck agent, an attacker) adds a bounded number of entries per interval
// plus one count of what was left out, instead of one entry per connection.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace flashpoint {
namespace xfer {

class ErrorLog {
 public:
  // Keeps at most max_kept entries (the oldest dropped and counted); of the rate-limited kind at
  // most burst entries per interval_s, the rest counted as suppressed.
  explicit ErrorLog(size_t max_kept = 1000, size_t burst = 10, double interval_s = 60.0);

  // An error of an authenticated transfer (a peer that holds the job secret): always kept.
  void record(const std::string& message);
  // An error about a connection that did not authenticate (refused address, handshake timeout,
  // wrong secret, garbage): kept within the rate limit, else only counted.
  void record_unauthenticated(const std::string& message);
  // The entries since the last call, oldest first, then cleared. Drops and suppressions since the
  // last call appear as one entry each that says how many and where the counts are.
  std::vector<std::string> take();
  // Rate-limited messages left out since the server started.
  uint64_t suppressed_total() const;

 private:
  void keep(const std::string& message);  // with mutex_ held

  const size_t max_kept_;
  const size_t burst_;
  const std::chrono::steady_clock::duration interval_;
  mutable std::mutex mutex_;
  std::deque<std::string> entries_;
  uint64_t dropped_ = 0;           // since the last take(), beyond max_kept
  uint64_t suppressed_ = 0;        // since the last take(), beyond the rate limit
  uint64_t suppressed_total_ = 0;  // since the start
  std::chrono::steady_clock::time_point window_start_{};
  size_t in_window_ = 0;
  bool window_open_ = false;
};

}  // namespace xfer
}  // namespace flashpoint
