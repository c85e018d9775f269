// Space of receptions in flight: before its data flows, a reception reserves the bytes it will
// add to the file system, so two receptions that do not fit together are not both accepted, and
// a margin stays free for the node's own saves.
#pragma once

#include <sys/statvfs.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "transfer.hpp"

namespace flashpoint {

class SpaceLedger {
 public:
  // margin_bytes: kept free for the node's own saves; negative: 1/32 of the file system's size.
  explicit SpaceLedger(int64_t margin_bytes) : margin_(margin_bytes) {}

  // One reception's reservation, released when it is destroyed (after its file is committed or removed).
  class Hold {
   public:
    Hold(SpaceLedger* ledger, uint64_t need) : ledger_(ledger), need_(need) {}
    ~Hold() { ledger_->release(this); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    // The reception has now allocated bytes of its reservation (they show in the free space).
    void landed(uint64_t bytes) {
      uint64_t seen = landed_.load(std::memory_order_relaxed);
      while (bytes > seen && !landed_.compare_exchange_weak(seen, bytes, std::memory_order_relaxed)) {
      }
    }
    uint64_t outstanding() const {
      const uint64_t landed = landed_.load(std::memory_order_relaxed);
      return landed >= need_ ? 0 : need_ - landed;
    }

   private:
    SpaceLedger* ledger_;
    uint64_t need_;
    std::atomic<uint64_t> landed_{0};
  };

  // Reserves need bytes on dir_fd's file system for what, or throws TransferNoSpaceError.
  std::unique_ptr<Hold> reserve(int dir_fd, uint64_t need, const std::string& what) {
    std::lock_guard<std::mutex> lk(m_);
    struct statvfs vfs;
    if (need > 0 && ::fstatvfs(dir_fd, &vfs) == 0 && vfs.f_frsize > 0) {
      const uint64_t free_bytes = uint64_t(vfs.f_bavail) * vfs.f_frsize;
      const uint64_t margin = margin_ >= 0 ? uint64_t(margin_) : uint64_t(vfs.f_blocks) * vfs.f_frsize / 32;
      uint64_t promised = 0;
      for (const Hold* h : holds_) promised += h->outstanding();
      if (need > free_bytes || promised > free_bytes - need || margin > free_bytes - need - promised)
        throw TransferNoSpaceError("no room for " + what + ": it needs " + std::to_string(need) + " bytes; " +
                                   std::to_string(free_bytes) + " are free, " + std::to_string(promised) +
                                   " of them promised to " + std::to_string(holds_.size()) +
                                   " reception(s) in flight, and " + std::to_string(margin) +
                                   " are kept free for this node's own saves");
    }
    std::unique_ptr<Hold> hold(new Hold(this, need));
    holds_.insert(hold.get());
    return hold;
  }

 private:
  void release(const Hold* h) {
    std::lock_guard<std::mutex> lk(m_);
    holds_.erase(h);
  }

  std::mutex m_;
  std::set<const Hold*> holds_;
  int64_t margin_;
};

}  // namespace flashpoint
