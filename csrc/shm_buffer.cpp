#include "shm_buffer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "errors.hpp"
#include "mappings.hpp"

namespace flashpoint {

namespace {

constexpr size_t kPrefaultChunk = size_t(64) << 20;  // re-check for close() this often

size_t round_up_to_page(size_t n) {
  const size_t page = page_size();
  if (n == 0) return page;
  return (n + page - 1) / page * page;
}

// posix_fallocate returns the error instead of setting errno.
void reserve_space(int fd, size_t size, const std::string& path) {
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  } while (err == EINTR);
  if (err != 0) throw OsError(err, "cannot reserve " + std::to_string(size) + " bytes for " + path, path);
}

uint8_t* map_file(int fd, size_t size, bool writable, const std::string& path) {
  uint8_t* p = map_file_aligned(fd, size, writable ? (PROT_READ | PROT_WRITE) : PROT_READ);
  if (p == nullptr) throw OsError(errno, "cannot map " + path, path);
  return p;
}

// On a tmpfs that hands out huge pages only when asked (huge=advise), pages are huge only if
// the first touch comes through a mapping that asked (map_file_aligned does): posix_fallocate
// alone would allocate 4 KiB pages. So a new file's first 2 MiB are populated through the
// mapping; if that took one fault the pages are huge and the whole buffer is populated now (for
// huge pages that costs little more than the zeroing the first write would do anyway). Otherwise
// the probe's page-table entries are dropped (the pages stay in the file) and the buffer is
// left to be pre-faulted later, as on any 4 KiB-page tmpfs.
void populate_if_huge(uint8_t* data, size_t size) {
  if (size < kHugePageBytes) return;
  const long faults = populate_counting_faults(data, kHugePageBytes, true);
  if (faults >= 0 && faults <= 2) {
    ::madvise(data, size, kMadvPopulateWrite);  // best effort: posix_fallocate reports ENOSPC next
  } else {
    ::madvise(data, kHugePageBytes, MADV_DONTNEED);
  }
}

// Touches one byte per page; the fallback when MADV_POPULATE_* is missing.
void touch_pages(uint8_t* begin, size_t length, bool write) {
  const size_t page = page_size();
  volatile uint8_t* p = begin;
  for (size_t off = 0; off < length; off += page) {
    if (write) {
      // An atomic no-op write: faults the page in writable without changing it.
      __atomic_fetch_add(begin + off, static_cast<uint8_t>(0), __ATOMIC_RELAXED);
    } else {
      (void)p[off];
    }
  }
}

}  // namespace

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

ShmBuffer::ShmBuffer(std::string path, int fd, uint8_t* data, size_t size, bool writable)
    : path_(std::move(path)), fd_(fd), data_(data), size_(size), writable_(writable) {}

ShmBuffer::~ShmBuffer() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<ShmBuffer> ShmBuffer::create(const std::string& path, size_t size) {
  const size_t rounded = round_up_to_page(size);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw OsError(errno, "cannot create " + path, path);
  uint8_t* data = nullptr;
  try {
    // Sized first and mapped before any page exists, so that huge=advise gives huge pages; the
    // space is still reserved before the buffer is handed out (no page is ever left unbacked).
    if (::ftruncate(fd, static_cast<off_t>(rounded)) != 0) throw OsError(errno, "cannot size " + path, path);
    data = map_file(fd, rounded, true, path);
    populate_if_huge(data, rounded);
    reserve_space(fd, rounded, path);
    return std::unique_ptr<ShmBuffer>(new ShmBuffer(path, fd, data, rounded, true));
  } catch (...) {
    if (data != nullptr) ::munmap(data, rounded);
    ::close(fd);
    ::unlink(path.c_str());  // nothing half-made stays behind
    throw;
  }
}

std::unique_ptr<ShmBuffer> ShmBuffer::open(const std::string& path, bool writable) {
  int fd = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw OsError(errno, "cannot open " + path, path);
  try {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw OsError(errno, "cannot stat " + path, path);
    size_t size = static_cast<size_t>(st.st_size);
    if (size == 0 || size % page_size() != 0) {
      if (!writable) throw std::invalid_argument(path + " is empty or not page-sized; it is not a flashpoint buffer");
      size = round_up_to_page(size);
    }
    // A writable buffer must own its blocks: a sparse file would SIGBUS on a full tmpfs.
    if (writable) reserve_space(fd, size, path);
    uint8_t* data = map_file(fd, size, writable, path);
    return std::unique_ptr<ShmBuffer>(new ShmBuffer(path, fd, data, size, writable));
  } catch (...) {
    ::close(fd);
    throw;
  }
}

void ShmBuffer::check_open() const {
  if (data_ == nullptr) throw std::runtime_error("buffer " + path_ + " is closed");
}

void ShmBuffer::grow(size_t new_size) {
  std::unique_lock<std::shared_mutex> guard(lock_);
  check_open();
  if (!writable_) throw std::invalid_argument("buffer " + path_ + " is read-only and cannot grow");
  const size_t rounded = round_up_to_page(new_size);
  if (rounded <= size_) return;
  if (exports_.load() > 0)
    throw BufferBusyError("buffer " + path_ + " cannot grow while views of it exist; release them first");
  reserve_space(fd_, rounded, path_);
  uint8_t* p = remap_file_aligned(data_, size_, rounded);
  if (p == nullptr) throw OsError(errno, "cannot remap " + path_, path_);
  data_ = p;
  size_ = rounded;
}

void ShmBuffer::prefault(size_t offset, size_t length) {
  std::shared_lock<std::shared_mutex> guard(lock_);
  check_open();
  if (offset >= size_) return;
  length = std::min(length, size_ - offset);
  const size_t page = page_size();
  size_t begin = offset / page * page;
  const size_t end = offset + length;
  const int advice = writable_ ? kMadvPopulateWrite : kMadvPopulateRead;
  bool madvise_works = true;
  while (begin < end && !closing_.load(std::memory_order_relaxed)) {
    const size_t chunk = std::min(kPrefaultChunk, end - begin);
    if (madvise_works && ::madvise(data_ + begin, chunk, advice) != 0) {
      if (errno == EINVAL || errno == ENOSYS) {
        madvise_works = false;  // kernel before 5.14: touch the pages ourselves
      } else if (errno == EINTR || errno == EAGAIN) {
        continue;
      } else {
        throw OsError(errno, "cannot prefault " + path_, path_);
      }
    }
    if (!madvise_works) touch_pages(data_ + begin, chunk, writable_);
    begin += chunk;
  }
}

void ShmBuffer::rename_to(const std::string& new_path) {
  std::unique_lock<std::shared_mutex> guard(lock_);
  check_open();  // a closed buffer's path may name someone else's file by now
  if (::rename(path_.c_str(), new_path.c_str()) != 0)
    throw OsError(errno, "cannot rename " + path_ + " to " + new_path, new_path);
  path_ = new_path;
}

void ShmBuffer::close() {
  if (exports_.load() > 0)
    throw BufferBusyError("buffer " + path_ + " cannot be closed while views of it exist; release them first");
  closing_.store(true);
  std::unique_lock<std::shared_mutex> guard(lock_);
  if (exports_.load() > 0) {
    closing_.store(false);
    throw BufferBusyError("buffer " + path_ + " cannot be closed while views of it exist; release them first");
  }
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace flashpoint
