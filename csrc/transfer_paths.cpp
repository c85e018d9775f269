// Confined filesystem access (see transfer_paths.hpp).
#include "transfer_paths.hpp"

namespace flashpoint {

std::vector<std::string> split_relative_path(const std::string& path) {
  using xfer::quoted;
  auto refuse = [&](const std::string& why) -> void {
    throw TransferPathError("path " + quoted(path) + " refused: " + why);
  };
  if (path.empty()) refuse("empty");
  if (path.size() > kTransferMaxPathBytes)
    refuse("longer than " + std::to_string(kTransferMaxPathBytes) + " bytes (" + std::to_string(path.size()) + ")");
  if (path.find('\0') != std::string::npos) refuse("contains a NUL byte");
  if (path[0] == '/') refuse("absolute paths are not allowed");
  std::vector<std::string> comps;
  size_t start = 0;
  for (;;) {
    const size_t slash = path.find('/', start);
    const std::string comp = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (comp.empty()) refuse("empty path component");
    if (comp == "." || comp == "..") refuse("'" + comp + "' components are not allowed");
    if (comp.size() > 255) refuse("a component is longer than 255 bytes");
    comps.push_back(comp);
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return comps;
}

namespace xfer {

// Opens (and with create, makes) the directories comps[0..count-1] under base_fd, one
// component at a time with O_NOFOLLOW, so nothing resolves outside the base directory.
Fd open_confined_dirs(int base_fd, const std::vector<std::string>& comps, size_t count, const std::string& path,
                      bool create) {
  Fd cur(::fcntl(base_fd, F_DUPFD_CLOEXEC, 0));
  if (cur.get() < 0) throw OsError(errno, "dup of the base directory failed", "");
  for (size_t i = 0; i < count; ++i) {
    int fd = ::openat(cur.get(), comps[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && create) {
      if (::mkdirat(cur.get(), comps[i].c_str(), 0755) != 0 && errno != EEXIST)
        throw OsError(errno, "cannot create directory " + quoted(comps[i]) + " for " + quoted(path), path);
      fd = ::openat(cur.get(), comps[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
      const int err = errno;
      if (err == ELOOP || err == ENOTDIR)
        throw TransferPathError("path " + quoted(path) + " refused: component " + quoted(comps[i]) +
                                " is a symlink or not a directory");
      if (err == ENOENT) throw OsError(ENOENT, "object " + quoted(path) + " not found: no directory " + quoted(comps[i]), path);
      throw OsError(err, "cannot open directory " + quoted(comps[i]) + " of " + quoted(path), path);
    }
    cur = Fd(fd);
  }
  return cur;
}

// The directory that holds the object at comps (every component but the last), confined.
Fd open_parent_dir(int base_fd, const std::vector<std::string>& comps, const std::string& path, bool create) {
  return open_confined_dirs(base_fd, comps, comps.size() - 1, path, create);
}

// The spare directory (relative to base_fd), confined; an empty Fd when it is not configured or
// does not exist (yet). Spares only speed receptions up, so any other problem also means "none".
Fd open_spare_dir(int base_fd, const std::string& spare_dir) {
  if (spare_dir.empty()) return Fd();
  try {
    const auto comps = split_relative_path(spare_dir);
    return open_confined_dirs(base_fd, comps, comps.size(), spare_dir, false);
  } catch (const std::exception&) {
    return Fd();
  }
}

// Opens an existing regular file under base_fd for reading, confined.
Fd open_confined_for_read(int base_fd, const std::string& path, uint64_t* size_out, bool refuse_hard_links) {
  const auto comps = split_relative_path(path);
  Fd dir = open_parent_dir(base_fd, comps, path, false);
  const int fd = ::openat(dir.get(), comps.back().c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) throw TransferPathError("path " + quoted(path) + " refused: it is a symlink");
    if (err == ENOENT) throw OsError(ENOENT, "object " + quoted(path) + " not found", path);
    throw OsError(err, "cannot open " + quoted(path), path);
  }
  Fd file(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) throw OsError(errno, "fstat failed", path);
  if (!S_ISREG(st.st_mode)) throw TransferPathError("path " + quoted(path) + " refused: not a regular file");
  if (refuse_hard_links && st.st_nlink > 1)
    throw TransferPathError("path " + quoted(path) + " refused: it has " + std::to_string(st.st_nlink) +
                            " hard links (only singly linked files are served; a link could expose a file from "
                            "outside the checkpoint tree)");
  // Back to blocking for pread (O_NONBLOCK only kept a FIFO from blocking the open).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  *size_out = static_cast<uint64_t>(st.st_size);
  return file;
}

Fd open_base_dir(const std::string& dir) {
  if (dir.empty()) throw std::invalid_argument("base directory must not be empty");
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw OsError(errno, "cannot open base directory " + quoted(dir), dir);
  return Fd(fd);
}

}  // namespace xfer
}  // namespace flashpoint
