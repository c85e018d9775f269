// Receiving into warm pages: writable mappings of spare files, populated ahead of the receiver,
// and a cache that keeps them across receptions.
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "transfer_wire.hpp"

namespace flashpoint {
namespace xfer {

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

}  // namespace xfer

// Mappings of files this server received into, kept after the reception: the file becomes a
// replica, is retired into the spare directory (renamed, same inode) and is taken back by a
// later reception, which then writes through the kept mapping with no page-table set-up and
// no tear-down (about a sixth of a steady reception's CPU time). Holding a mapping keeps the
// memory of a file deleted meanwhile alive, so entries of deleted files are dropped at every
// use and every second, and only a few mappings are kept.
class WarmMappingCache {
 public:
  // The kept mapping of this file (now the caller's), if it covers at least length bytes.
  std::unique_ptr<xfer::WarmMapping> take(const struct stat& st, uint64_t length) {
    drop_deleted();
    std::unique_ptr<xfer::WarmMapping> found;
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
  void keep(int fd, std::unique_ptr<xfer::WarmMapping> map) {
    if (!map) return;
    map->settle();
    struct stat st;
    if (!map->fully_populated() || ::fstat(fd, &st) != 0) return;
    xfer::Fd file(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
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
    xfer::Fd file;
    std::unique_ptr<xfer::WarmMapping> map;
  };
  std::mutex m_;
  std::deque<Entry> entries_;     // oldest first
  std::vector<Entry> graveyard_;  // taken out under the lock, unmapped outside it
};

}  // namespace flashpoint
