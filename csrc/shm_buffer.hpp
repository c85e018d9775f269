// A file on a tmpfs mapped MAP_SHARED into this process.
//
// Space is reserved with posix_fallocate before a buffer is handed out, so a
// full tmpfs is reported as ENOSPC when the buffer is created or grown, never as
// a SIGBUS when a page is first written. Mappings start on a 2 MiB boundary and
// ask for huge pages (mappings.hpp): where the tmpfs gives them, a buffer is
// populated with far fewer faults and a later mapping of it, e.g. a load after a
// restart, fills its page tables almost for free. Operations that touch the
// mapping hold a shared lock; close() and grow() take it exclusively, so a
// background prefault can never run on an unmapped range.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>

namespace flashpoint {

class ShmBuffer {
 public:
  // Creates a new file (fails if it exists) of at least `size` bytes. On a tmpfs that gives this
  // mapping huge pages, they are populated now (cheap for huge pages); otherwise, pages are only
  // reserved and prefault() maps them in later.
  static std::unique_ptr<ShmBuffer> create(const std::string& path, size_t size);
  // Maps an existing file; its current size is the buffer size.
  static std::unique_ptr<ShmBuffer> open(const std::string& path, bool writable);

  ~ShmBuffer();
  ShmBuffer(const ShmBuffer&) = delete;
  ShmBuffer& operator=(const ShmBuffer&) = delete;

  // Extends the file and the mapping to at least new_size bytes; existing
  // pages (and their contents) are kept.
  void grow(size_t new_size);
  // Faults in the pages of [offset, offset+length) for writing (or reading for
  // read-only buffers) so that later copies run at memory speed. Returns early,
  // without error, if the buffer is closed meanwhile.
  void prefault(size_t offset, size_t length);
  // Renames the backing file; the mapping stays valid.
  void rename_to(const std::string& new_path);
  // Unmaps and closes. Refused while Python views of the buffer exist.
  void close();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool writable() const { return writable_; }
  bool closed() const { return data_ == nullptr; }
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

  // Lock held by any operation that reads or writes the mapping.
  std::shared_mutex& mapping_lock() { return lock_; }
  // Count of live Python buffer-protocol views.
  std::atomic<int>& exports() { return exports_; }
  // Throws if the buffer is closed; call with mapping_lock() held.
  void check_open() const;

 private:
  ShmBuffer(std::string path, int fd, uint8_t* data, size_t size, bool writable);

  std::string path_;
  int fd_;
  uint8_t* data_;
  size_t size_;
  bool writable_;
  std::atomic<bool> closing_{false};
  std::atomic<int> exports_{0};
  std::shared_mutex lock_;
};

size_t page_size();

}  // namespace flashpoint
