// See transfer_steps.hpp.
#include "transfer_steps.hpp"

#include <sys/stat.h>

#include "transfer_wire.hpp"

namespace flashpoint {
namespace xfer {
namespace {

constexpr size_t kMaxEntriesRead = 100000;  // bounds the work of one decision

// Calls visit(name) for the entries of dir_fd (at most kMaxEntriesRead) until it returns true. Reads
// through a fresh open of the directory: a dup would share dir_fd's read position with other threads.
template <typename Visit>
bool any_entry(int dir_fd, Visit visit) {
  const int dup_fd = ::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dup_fd < 0) return false;
  DIR* dir = ::fdopendir(dup_fd);
  if (!dir) {
    ::close(dup_fd);
    return false;
  }
  bool found = false;
  for (size_t seen = 0; seen < kMaxEntriesRead && !found; ++seen) {
    const struct dirent* e = ::readdir(dir);
    if (!e) break;
    found = visit(std::string(e->d_name));
  }
  ::closedir(dir);
  return found;
}

bool is_regular_file(int dir_fd, const std::string& name, uint64_t* size = nullptr) {
  struct stat st;
  if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) return false;
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return true;
}

Fd open_version_dir(int base_fd, const std::string& name) {
  return Fd(::openat(base_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
}

// True when the version directory holds what only this node writes there: an object of one of its
// ranks, or a version file (its commit record, say).
bool saved_here(int base_fd, const TransferPolicy& policy, const std::string& dir_name) {
  Fd dir = open_version_dir(base_fd, dir_name);
  if (dir.get() < 0) return false;
  return any_entry(dir.get(), [&](const std::string& name) {
    return (policy.is_own_object(name) || policy.is_version_file(name)) && is_regular_file(dir.get(), name);
  });
}

// The size of file_name in the newest version directory older than step (false: none holds it).
bool previous_size(int base_fd, const TransferPolicy& policy, uint64_t step, const std::string& file_name,
                   uint64_t* size) {
  uint64_t newest = 0;
  std::string newest_name;
  any_entry(base_fd, [&](const std::string& name) {
    uint64_t s = 0;
    if (policy.version_step(name, &s) && s < step && (newest_name.empty() || s > newest)) {
      newest = s;
      newest_name = name;
    }
    return false;
  });
  if (newest_name.empty()) return false;
  Fd dir = open_version_dir(base_fd, newest_name);
  return dir.get() >= 0 && is_regular_file(dir.get(), file_name, size);
}

}  // namespace

std::string refuse_push_into_version(int base_fd, const TransferPolicy& policy, const std::string& dir_name,
                                     const std::string& file_name, uint64_t step, uint64_t size, bool size_recorded,
                                     bool* too_large) {
  *too_large = false;
  if (!saved_here(base_fd, policy, dir_name))
    return "this node holds no object of its own ranks and no version file in step " + std::to_string(step) +
           ": it has not saved that step, so no placement pushes it here (a push follows the step's commit on "
           "every node)";
  if (size_recorded) return "";
  uint64_t before = 0;
  if (previous_size(base_fd, policy, step, file_name, &before) && before <= UINT64_MAX / kUnrecordedGrowthLimit &&
      size > before * kUnrecordedGrowthLimit) {
    *too_large = true;
    return "it announces " + std::to_string(size) + " bytes, more than " + std::to_string(kUnrecordedGrowthLimit) +
           " times the " + std::to_string(before) + " bytes of the same object in the previous version here, and no "
           "commit record of this node gives its size yet";
  }
  return "";
}

}  // namespace xfer
}  // namespace flashpoint
