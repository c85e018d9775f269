#include "copy_engine.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>

#include "crc32c.hpp"
#include "errors.hpp"

namespace flashpoint {
namespace {

constexpr uint64_t kPieceBytes = uint64_t(4) << 20;      // large ops are split into pieces this big
constexpr uint64_t kTaskBytes = uint64_t(1) << 20;       // small pieces are grouped into tasks this big
constexpr uint64_t kReadChunk = uint64_t(256) << 10;     // unmappable files: one pread per chunk, checksummed in L2
constexpr uint64_t kSingleThreadBytes = uint64_t(8) << 20;  // below this, threads cost more than they gain

struct Piece {
  size_t op;
  uint64_t offset;  // within the op
  uint64_t nbytes;
  uint32_t crc;
};

// Runs piece_fn over all pieces of the given op lengths on up to `threads`
// threads, then folds the piece CRCs of each op into one CRC.
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

// pread exactly n bytes or throw; the only way a read path fails.
void pread_fully(int fd, uint8_t* dst, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, dst, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw OsError(errno, "read failed at offset " + std::to_string(offset), "");
    }
    if (got == 0)
      throw ShortReadError("file ends at offset " + std::to_string(offset) + " but " + std::to_string(n) +
                           " more bytes were expected");
    dst += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

// A read-only shared mapping of a whole regular file, so that a load can copy and checksum each
// block in one pass (a pread copies in the kernel and the checksum then re-reads the bytes).
// Every range is checked against the file's size before any byte moves; a file truncated by
// another process while it is mapped would fault (SIGBUS), as any mapped buffer would.
class FileMapping {
 public:
  explicit FileMapping(int fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw OsError(errno, "fstat failed", "");
    size_ = static_cast<uint64_t>(st.st_size);
    if (!S_ISREG(st.st_mode) || size_ == 0) return;  // nothing to map: reads take the pread path
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) data_ = static_cast<const uint8_t*>(p);
  }
  ~FileMapping() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  bool mapped() const { return data_ != nullptr; }
  uint64_t size() const { return size_; }

  // Throws ShortReadError when [offset, +n) is not inside the file.
  void check_range(uint64_t offset, uint64_t n) const {
    if (offset > size_ || n > size_ - offset)
      throw ShortReadError("file ends at offset " + std::to_string(size_) + " but a read of " + std::to_string(n) +
                           " bytes at offset " + std::to_string(offset) + " was expected");
  }

  // The bytes at offset, with their page-table entries filled in one call instead of a fault
  // every few pages (a hint: old kernels without MADV_POPULATE_READ fault them in as usual).
  const uint8_t* populated(uint64_t offset, uint64_t n) const {
    constexpr int kPopulateRead = 22;  // MADV_POPULATE_READ, Linux 5.14
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t start = offset / page * page;
    ::madvise(const_cast<uint8_t*>(data_) + start, offset + n - start, kPopulateRead);
    return data_ + offset;
  }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

template <typename Op>
std::vector<uint64_t> lengths_of(const std::vector<Op>& ops) {
  std::vector<uint64_t> lengths;
  lengths.reserve(ops.size());
  for (const Op& op : ops) lengths.push_back(op.nbytes);
  return lengths;
}

void check_in_bounds(const ShmBuffer& buffer, uint64_t offset, uint64_t nbytes) {
  if (offset > buffer.size() || nbytes > buffer.size() - offset)
    throw std::out_of_range("range [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
                            ") is outside buffer " + buffer.path() + " of " + std::to_string(buffer.size()) +
                            " bytes");
}

}  // namespace

std::vector<uint32_t> copy_into_buffer(ShmBuffer& buffer, const std::vector<MemToBufferOp>& ops, bool checksum,
                                       int threads, bool streaming) {
  std::shared_lock<std::shared_mutex> guard(buffer.mapping_lock());
  buffer.check_open();
  if (!buffer.writable()) throw std::invalid_argument("buffer " + buffer.path() + " is read-only");
  for (const auto& op : ops) check_in_bounds(buffer, op.dst_offset, op.nbytes);
  uint8_t* base = buffer.data();
  return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
    const auto& op = ops[p.op];
    const uint8_t* src = reinterpret_cast<const uint8_t*>(op.src_address) + p.offset;
    uint8_t* dst = base + op.dst_offset + p.offset;
    if (!streaming) {
      std::memcpy(dst, src, p.nbytes);
      return checksum ? crc32c(dst, p.nbytes) : uint32_t(0);
    }
    if (!checksum) {
      copy_streaming(dst, src, p.nbytes);
      return uint32_t(0);
    }
    return crc32c_copy(dst, src, p.nbytes);
  });
}

std::vector<uint32_t> read_file_into(int fd, const std::vector<FileToMemOp>& ops, bool checksum, int threads) {
  for (const auto& op : ops) {
    if (op.nbytes > op.dst_capacity)
      throw std::out_of_range("a read of " + std::to_string(op.nbytes) + " bytes at file offset " +
                              std::to_string(op.file_offset) + " overruns its destination of " +
                              std::to_string(op.dst_capacity) + " bytes");
  }
  const FileMapping file(fd);
  for (const auto& op : ops) file.check_range(op.file_offset, op.nbytes);
  if (file.mapped()) {
    return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
      const auto& op = ops[p.op];
      uint8_t* dst = reinterpret_cast<uint8_t*>(op.dst_address) + p.offset;
      const uint8_t* src = file.populated(op.file_offset + p.offset, p.nbytes);
      if (checksum) return crc32c_copy(dst, src, p.nbytes);
      copy_streaming(dst, src, p.nbytes);
      return uint32_t(0);
    });
  }
  return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
    const auto& op = ops[p.op];
    uint8_t* dst = reinterpret_cast<uint8_t*>(op.dst_address) + p.offset;
    const uint64_t file_offset = op.file_offset + p.offset;
    uint32_t crc = 0;
    for (uint64_t done = 0; done < p.nbytes; done += kReadChunk) {
      const uint64_t m = std::min(kReadChunk, p.nbytes - done);
      pread_fully(fd, dst + done, m, file_offset + done);
      if (checksum) crc = crc32c(dst + done, m, crc);
    }
    return crc;
  });
}

std::vector<uint32_t> checksum_file_ranges(int fd, const std::vector<RangeOp>& ops, int threads) {
  const FileMapping file(fd);
  for (const auto& op : ops) file.check_range(op.offset, op.nbytes);
  if (file.mapped()) {
    return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
      return crc32c(file.populated(ops[p.op].offset + p.offset, p.nbytes), p.nbytes);
    });
  }
  return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
    thread_local std::vector<uint8_t> scratch(kReadChunk);
    const uint64_t file_offset = ops[p.op].offset + p.offset;
    uint32_t crc = 0;
    for (uint64_t done = 0; done < p.nbytes; done += kReadChunk) {
      const uint64_t m = std::min(kReadChunk, p.nbytes - done);
      pread_fully(fd, scratch.data(), m, file_offset + done);
      crc = crc32c(scratch.data(), m, crc);
    }
    return crc;
  });
}

std::vector<uint32_t> checksum_buffer_ranges(ShmBuffer& buffer, const std::vector<RangeOp>& ops, int threads) {
  std::shared_lock<std::shared_mutex> guard(buffer.mapping_lock());
  buffer.check_open();
  for (const auto& op : ops) check_in_bounds(buffer, op.offset, op.nbytes);
  const uint8_t* base = buffer.data();
  return run_pieces(lengths_of(ops), threads,
                    [&](const Piece& p) { return crc32c(base + ops[p.op].offset + p.offset, p.nbytes); });
}

}  // namespace flashpoint
