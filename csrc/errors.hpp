// Exceptions thrown by the C++ core; the bindings turn them into Python errors.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace flashpoint {

// A failed system call: becomes a Python OSError carrying errno and the path,
// so callers can tell ENOSPC from EACCES from anything else.
class OsError : public std::runtime_error {
 public:
  OsError(int err, const std::string& what, std::string path)
      : std::runtime_error(what + ": " + std::strerror(err)), errno_(err), path_(std::move(path)) {}
  int error_number() const { return errno_; }
  const std::string& path() const { return path_; }

 private:
  int errno_;
  std::string path_;
};

// A file ended before the bytes its index promised: becomes Python EOFError.
class ShortReadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A buffer cannot be closed or resized while Python views of it exist:
// becomes Python BufferError.
class BufferBusyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace flashpoint
