#include "pieces.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "crc32c.hpp"

namespace flashpoint {
namespace {

constexpr uint64_t kTaskBytes = uint64_t(1) << 20;          // small pieces are grouped into tasks this big
constexpr uint64_t kSingleThreadBytes = uint64_t(8) << 20;  // below this, threads cost more than they gain

}  // namespace

std::vector<uint32_t> run_pieces(const std::vector<uint64_t>& lengths, int threads,
                                 const std::function<uint32_t(const Piece&)>& piece_fn) {
  std::vector<Piece> pieces;
  pieces.reserve(lengths.size());
  uint64_t total = 0;
  for (size_t op = 0; op < lengths.size(); ++op) {
    const uint64_t n = lengths[op];
    total += n;
    if (n == 0) continue;
    for (uint64_t off = 0; off < n; off += kPieceBytes) pieces.push_back({op, off, std::min(kPieceBytes, n - off), 0});
  }

  // Tasks are runs of consecutive pieces of about kTaskBytes (or one big piece).
  std::vector<size_t> task_starts;
  uint64_t acc = kTaskBytes;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (acc >= kTaskBytes) {
      task_starts.push_back(i);
      acc = 0;
    }
    acc += pieces[i].nbytes;
  }
  task_starts.push_back(pieces.size());
  const size_t n_tasks = task_starts.size() - 1;

  std::atomic<size_t> next_task{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&]() {
    for (;;) {
      const size_t t = next_task.fetch_add(1);
      if (t >= n_tasks || failed.load(std::memory_order_relaxed)) return;
      try {
        for (size_t i = task_starts[t]; i < task_starts[t + 1]; ++i) pieces[i].crc = piece_fn(pieces[i]);
      } catch (...) {
        std::lock_guard<std::mutex> g(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed.store(true);
        return;
      }
    }
  };

  size_t n_threads = static_cast<size_t>(std::max(1, threads));
  if (total < kSingleThreadBytes) n_threads = 1;
  n_threads = std::min(n_threads, std::max<size_t>(1, n_tasks));
  std::vector<std::thread> helpers;
  helpers.reserve(n_threads - 1);
  for (size_t i = 1; i < n_threads; ++i) helpers.emplace_back(worker);
  worker();
  for (auto& h : helpers) h.join();
  if (first_error) std::rethrow_exception(first_error);

  std::vector<uint32_t> crcs(lengths.size(), 0);
  std::vector<bool> started(lengths.size(), false);
  for (const Piece& p : pieces) {
    if (!started[p.op]) {
      crcs[p.op] = p.crc;
      started[p.op] = true;
    } else {
      crcs[p.op] = crc32c_combine(crcs[p.op], p.crc, p.nbytes);
    }
  }
  return crcs;
}

}  // namespace flashpoint
