// Sweeping temporary files left by receptions that died with their process (see
// transfer_temp_object.hpp). A live reception holds an exclusive flock on its temporary file,
// so a file whose lock can be taken belongs to nobody; the age check also spares a file in the
// instant between its creation and its lock.
#include <time.h>

#include <cctype>

#include "transfer_temp_object.hpp"

namespace flashpoint {
namespace xfer {
namespace {

constexpr size_t kMaxSweptEntriesPerDir = 100000;  // bounds the work of one start
constexpr time_t kMinAgeSeconds = 5;

// Removes the stale temporary files directly inside dir_fd; returns how many.
size_t sweep_dir(int dir_fd, std::vector<std::string>* subdirs) {
  const int dup_fd = ::fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return 0;
  DIR* dir = ::fdopendir(dup_fd);
  if (!dir) {
    ::close(dup_fd);
    return 0;
  }
  size_t removed = 0;
  const time_t now = ::time(nullptr);
  for (size_t seen = 0; seen < kMaxSweptEntriesPerDir; ++seen) {
    const struct dirent* e = ::readdir(dir);
    if (!e) break;
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      if (subdirs) subdirs->push_back(name);
      continue;
    }
    if (!S_ISREG(st.st_mode) || !is_temp_name(name) || now - st.st_mtime < kMinAgeSeconds) continue;
    const int fd = ::openat(dir_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) continue;
    Fd file(fd);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;  // a live reception holds it
    if (::unlinkat(dir_fd, name.c_str(), 0) == 0) ++removed;
  }
  ::closedir(dir);
  return removed;
}

}  // namespace

bool is_temp_name(const std::string& name) {
  static const std::string prefix = ".xfer-", suffix = ".tmp";
  if (name.size() != prefix.size() + 16 + suffix.size()) return false;
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  for (size_t i = prefix.size(); i < prefix.size() + 16; ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i])) || std::isupper(static_cast<unsigned char>(name[i])))
      return false;
  return true;
}

size_t sweep_stale_temp_files(int base_fd) {
  try {
    std::vector<std::string> subdirs;
    size_t removed = sweep_dir(base_fd, &subdirs);
    for (const std::string& name : subdirs) {
      const int fd = ::openat(base_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0) continue;
      Fd dir(fd);
      removed += sweep_dir(dir.get(), nullptr);
    }
    return removed;
  } catch (const std::exception&) {
    return 0;  // out of memory for the names: nothing swept this time
  }
}

}  // namespace xfer
}  // namespace flashpoint
