// The receiving end of an object: a hidden temporary file next to its destination, whose pages
// come from a spare file when one is available, renamed into place only after every check.
#pragma once

#include <dirent.h>
#include <sys/file.h>
#include <sys/statvfs.h>

#include "transfer_paths.hpp"
#include "transfer_space.hpp"
#include "transfer_warm.hpp"

namespace flashpoint {
namespace xfer {

// Name of a reception's temporary file: ".xfer-" + 16 hex digits + ".tmp", next to its destination.
// While a reception is in progress its process holds an exclusive flock on the file.
inline std::string new_temp_name() { return ".xfer-" + random_hex(8) + ".tmp"; }
bool is_temp_name(const std::string& name);
// Removes temporary files under base_fd (the base directory and its direct subdirectories)
// that no live reception holds (flock obtainable) and that are older than a few seconds.
// Returns how many it removed; never throws (a sweep only frees space).
size_t sweep_stale_temp_files(int base_fd);

// --- spare files --------------------------------------------------------------------------
//
// A spare is a retired replica's file, parked in the spare directory so that the next
// reception overwrites tmpfs pages that already exist instead of faulting in and zeroing
// fresh ones (about twice as fast here). A reception takes a spare by renaming it into the
// destination directory under its hidden temporary name: rename is atomic, so two receptions
// can never take the same spare (the loser's rename fails with ENOENT and it tries the next).

constexpr size_t kMaxSpareCandidates = 4096;  // bounds the work of one directory scan

struct SpareCandidate {
  std::string name;
  uint64_t size;
  bool mapped;  // this server still has a mapping of it: no page-table set-up needed
};

// Regular, singly linked, non-hidden files of the spare directory; anything else is ignored.
inline std::vector<SpareCandidate> list_spares(int spare_fd, WarmMappingCache* cache) {
  std::vector<SpareCandidate> out;
  const int dup_fd = ::fcntl(spare_fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return out;
  DIR* dir = ::fdopendir(dup_fd);
  if (!dir) {
    ::close(dup_fd);
    return out;
  }
  while (out.size() < kMaxSpareCandidates) {
    errno = 0;
    const struct dirent* e = ::readdir(dir);
    if (!e) break;
    if (e->d_name[0] == '.') continue;
    struct stat st;
    if (::fstatat(spare_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1 || st.st_size <= 0) continue;
    out.push_back({e->d_name, static_cast<uint64_t>(st.st_size), cache && cache->holds(st.st_dev, st.st_ino)});
  }
  ::closedir(dir);
  return out;
}

// Preference order for an object of size bytes: the smallest spare that holds it (one still
// mapped here first), then the other spares from the largest down (the more warm pages the better).
inline void order_spares(std::vector<SpareCandidate>& spares, uint64_t size) {
  std::sort(spares.begin(), spares.end(), [size](const SpareCandidate& a, const SpareCandidate& b) {
    const bool a_fits = a.size >= size, b_fits = b.size >= size;
    if (a_fits != b_fits) return a_fits;
    if (a_fits && a.mapped != b.mapped) return a.mapped;
    return a_fits ? a.size < b.size : a.size > b.size;
  });
}

// A hidden temporary file in the destination directory; removed unless commit() ran. Its
// pages come from a spare file when spare_fd names a spare directory that holds one. With a
// ledger, the bytes it adds are reserved there until it is gone (TransferNoSpaceError when
// they do not fit).
class TempObject {
 public:
  TempObject(int base_fd, const std::string& path, uint64_t size, int spare_fd = -1,
             WarmMappingCache* cache = nullptr, SpaceLedger* ledger = nullptr)
      : path_(path), cache_(cache) {
    const auto comps = split_relative_path(path);
    final_name_ = comps.back();
    dir_ = open_parent_dir(base_fd, comps, path, true);
    temp_name_ = new_temp_name();
    if (spare_fd >= 0 && size > 0) take_spare(spare_fd, size);
    const uint64_t new_bytes = size > warm_bytes_ ? size - warm_bytes_ : 0;
    if (ledger) {
      try {
        hold_ = ledger->reserve(dir_.get(), new_bytes, quoted(path));
      } catch (...) {
        discard();
        throw;
      }
    } else {
      check_space(new_bytes);
    }
    if (file_.get() < 0) create_file();
    if (::ftruncate(file_.get(), static_cast<off_t>(size)) != 0) {
      const int err = errno;
      discard();
      throw OsError(err, "cannot size the temporary file for " + quoted(path), path);
    }
  }
  ~TempObject() { discard(); }
  int fd() const { return file_.get(); }
  // Bytes at the start of the file whose pages already exist (taken from a spare).
  uint64_t warm_bytes() const { return warm_bytes_; }
  bool from_spare() const { return from_spare_; }

  // A mapping of the whole pages among the warm bytes (the cache's, else a new one), or nullptr
  // (too few, or it failed). It lives as long as this object, so unmapping (or handing it to
  // the cache) waits until the reply has been sent. Only its first mapped_bytes() are written.
  WarmMapping* map_warm_pages() {
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    mapped_bytes_ = warm_bytes_ / page * page;
    if (map_ || mapped_bytes_ < kMinMappedBytes) return map_.get();
    if (cache_) map_ = cache_->take(spare_stat_, mapped_bytes_);
    mapping_reused_ = map_ != nullptr;
    if (!map_) map_ = WarmMapping::map(file_.get(), mapped_bytes_);
    return map_.get();
  }
  uint64_t mapped_bytes() const { return mapped_bytes_; }
  bool mapping_reused() const { return mapping_reused_; }

  void write_at(const void* data, size_t n, uint64_t offset) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(file_.get(), p, n, static_cast<off_t>(offset));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw OsError(errno, "writing " + quoted(path_) + " failed", path_);
      }
      p += w;
      n -= static_cast<size_t>(w);
      offset += static_cast<uint64_t>(w);
    }
    if (hold_ && offset > warm_bytes_) hold_->landed(offset - warm_bytes_);  // pages past the spare's are new
  }

  // fsync, rename over the final name, fsync the directory.
  void commit() {
    if (::fsync(file_.get()) != 0) throw OsError(errno, "fsync of " + quoted(path_) + " failed", path_);
    if (::renameat(dir_.get(), temp_name_.c_str(), dir_.get(), final_name_.c_str()) != 0)
      throw OsError(errno, "cannot rename the received object into place as " + quoted(path_), path_);
    committed_ = true;
    ::fsync(dir_.get());
  }

 private:
  // Fail early and clearly when the file system cannot hold the new pages. (Space is not
  // reserved with fallocate: that costs a full extra pass over the pages; the pages are
  // allocated as the data lands, and ENOSPC then still ends the transfer cleanly.)
  void check_space(uint64_t new_bytes) {
    struct statvfs vfs;
    if (new_bytes > 0 && ::fstatvfs(dir_.get(), &vfs) == 0 && vfs.f_frsize > 0 &&
        new_bytes / vfs.f_frsize > static_cast<uint64_t>(vfs.f_bavail)) {
      const int err = ENOSPC;
      discard();
      throw OsError(err,
                    "cannot store " + std::to_string(new_bytes) + " more bytes for " + quoted(path_) + " (only " +
                        std::to_string(uint64_t(vfs.f_bavail) * vfs.f_frsize) + " bytes free)",
                    path_);
    }
  }

  void create_file() {
    const int fd = ::openat(dir_.get(), temp_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) throw OsError(errno, "cannot create a temporary file for " + quoted(path_), path_);
    file_ = Fd(fd);
    created_ = true;
    ::flock(fd, LOCK_EX | LOCK_NB);  // marks it in use for sweep_stale_temp_files
  }

  // Moves the best spare here under temp_name_; on any doubt the spare is skipped.
  void take_spare(int spare_fd, uint64_t size) {
    auto spares = list_spares(spare_fd, cache_);
    order_spares(spares, size);
    for (const auto& spare : spares) {
      if (::renameat(spare_fd, spare.name.c_str(), dir_.get(), temp_name_.c_str()) != 0) {
        if (errno == ENOENT) continue;  // another reception took it first
        return;                         // EXDEV (another file system) or worse: no spares here
      }
      created_ = true;  // from here on the destructor removes it unless it goes back
      if (adopt_taken_spare(size)) return;
      // Not a plain file any more (replaced between the scan and the rename): put it back.
      created_ = false;
      if (::renameat(dir_.get(), temp_name_.c_str(), spare_fd, spare.name.c_str()) != 0) {
        if (::unlinkat(dir_.get(), temp_name_.c_str(), 0) != 0) temp_name_ = new_temp_name();
        return;  // something odd is going on in the spare directory: no more spares this time
      }
    }
  }

  // Opens the spare just renamed to temp_name_; true if it is a regular file linked only here.
  bool adopt_taken_spare(uint64_t size) {
    const int fd = ::openat(dir_.get(), temp_name_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return false;
    Fd file(fd);
    ::flock(fd, LOCK_EX | LOCK_NB);  // marks it in use for sweep_stale_temp_files
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) return false;
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    // Only pages the spare really holds count as warm (a sparse spare has holes).
    const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
    const uint64_t length = static_cast<uint64_t>(st.st_size);
    warm_bytes_ = allocated >= length ? std::min(length, size) : 0;
    spare_stat_ = st;
    file_ = std::move(file);
    from_spare_ = true;
    return true;
  }

  void discard() {
    if (committed_ && cache_) cache_->keep(file_.get(), std::move(map_));
    map_.reset();
    file_.reset();
    if (created_ && !committed_) ::unlinkat(dir_.get(), temp_name_.c_str(), 0);
    created_ = false;
  }

  std::string path_, final_name_, temp_name_;
  Fd dir_, file_;
  WarmMappingCache* cache_;
  std::unique_ptr<WarmMapping> map_;
  std::unique_ptr<SpaceLedger::Hold> hold_;  // released after the file is committed or removed
  struct stat spare_stat_ {};
  uint64_t warm_bytes_ = 0, mapped_bytes_ = 0;
  bool created_ = false, committed_ = false, from_spare_ = false, mapping_reused_ = false;
};

}  // namespace xfer
}  // namespace flashpoint
