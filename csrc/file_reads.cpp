#include "file_reads.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>

#include "crc32c.hpp"
#include "errors.hpp"
#include "fault_guard.hpp"
#include "mappings.hpp"
#include "pieces.hpp"

namespace flashpoint {
namespace {

constexpr uint64_t kBounceBytes = uint64_t(512) << 10;  // per-thread pread target: stays in L2
constexpr uint64_t kBounceMin = uint64_t(256) << 10;    // smaller ranges are pread straight into place
// At most this many faults to populate 2 MiB means huge pages (one fault each; 4 KiB pages take
// one per fault-around window of 16 pages, i.e. 32).
constexpr long kHugeFaultsPer2MiB = 2;

// pread exactly n bytes or throw; the only way a pread path fails.
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

[[noreturn]] void throw_shrunk(uint64_t offset, uint64_t n) {
  throw ShortReadError("the file shrank while it was read: bytes [" + std::to_string(offset) + ", +" +
                       std::to_string(n) + ") are gone (another process truncated it)");
}

// A regular file's size, and a read-only mapping of all of it when the method asks for one.
class FileView {
 public:
  FileView(int fd, ReadMethod method, uint64_t probe_offset, uint64_t probe_nbytes) {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw OsError(errno, "fstat failed", "");
    size_ = static_cast<uint64_t>(st.st_size);
    if (method == ReadMethod::kPread || !S_ISREG(st.st_mode) || size_ == 0) return;
    data_ = map_file_aligned(fd, size_, PROT_READ);
    if (data_ == nullptr || method == ReadMethod::kMap) return;
    if (!pages_are_cheap(probe_offset, probe_nbytes)) unmap();
  }
  ~FileView() { unmap(); }
  FileView(const FileView&) = delete;
  FileView& operator=(const FileView&) = delete;

  bool mapped() const { return data_ != nullptr; }
  uint64_t size() const { return size_; }
  const uint8_t* data() const { return data_; }

  // Throws ShortReadError when [offset, +n) is not inside the file.
  void check_range(uint64_t offset, uint64_t n) const {
    if (offset > size_ || n > size_ - offset)
      throw ShortReadError("file ends at offset " + std::to_string(size_) + " but a read of " + std::to_string(n) +
                           " bytes at offset " + std::to_string(offset) + " was expected");
  }

 private:
  // Populates one 2 MiB-aligned window of the range to be read and counts the faults it took.
  bool pages_are_cheap(uint64_t offset, uint64_t n) const {
    const uint64_t window = (offset + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (window + kHugePageBytes > offset + n || window + kHugePageBytes > size_) return false;
    const long faults = populate_counting_faults(const_cast<uint8_t*>(data_) + window, kHugePageBytes, false);
    return faults >= 0 && faults <= kHugeFaultsPer2MiB;
  }

  void unmap() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
    data_ = nullptr;
  }

  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// The longest op whose range holds an aligned 2 MiB window decides (a cheap probe of the bytes
// the call reads anyway); none such: the reads are small and pread is as good.
template <typename Op, typename OffsetOf>
std::pair<uint64_t, uint64_t> probe_range(const std::vector<Op>& ops, OffsetOf offset_of) {
  std::pair<uint64_t, uint64_t> best{0, 0};
  for (const Op& op : ops)
    if (op.nbytes > best.second) best = {offset_of(op), op.nbytes};
  return best;
}

// What a guarded copy needs; run_guarded passes it through a void*.
struct CopyJob {
  uint8_t* dst;
  const uint8_t* src;
  uint64_t n;
  bool checksum;
  uint32_t crc;
};

void run_copy_job(void* arg) {
  auto* job = static_cast<CopyJob*>(arg);
  if (job->dst == nullptr) {
    job->crc = crc32c(job->src, job->n);
  } else if (job->checksum) {
    job->crc = crc32c_copy(job->dst, job->src, job->n);
  } else {
    copy_streaming(job->dst, job->src, job->n);
  }
}

// Copies (dst != nullptr) or checksums [offset, +n) of a file mapped at `base`; throws if the file
// shrank. The copy faults the pages in as it goes: the map path is taken for huge pages, one fault
// per 2 MiB, where populating them first (MADV_POPULATE_READ) saves nothing (measured); a pool
// buffer's pages are mapped already.
uint32_t copy_mapped(const uint8_t* base, uint64_t offset, uint64_t n, uint8_t* dst, bool checksum) {
  CopyJob job{dst, base + offset, n, checksum, 0};
  if (!run_guarded(job.src, n, run_copy_job, &job)) throw_shrunk(offset, n);
  return job.crc;
}

// Every op copied from the file mapped at `base` (ranges checked by the caller), guarded.
std::vector<uint32_t> copy_ops_mapped(const uint8_t* base, const std::vector<FileToMemOp>& ops, bool checksum,
                                      int threads) {
  install_fault_guard();
  return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
    const auto& op = ops[p.op];
    return copy_mapped(base, op.file_offset + p.offset, p.nbytes,
                       reinterpret_cast<uint8_t*>(op.dst_address) + p.offset, checksum);
  });
}

void check_capacities(const std::vector<FileToMemOp>& ops) {
  for (const auto& op : ops) {
    if (op.nbytes > op.dst_capacity)
      throw std::out_of_range("a read of " + std::to_string(op.nbytes) + " bytes at file offset " +
                              std::to_string(op.file_offset) + " overruns its destination of " +
                              std::to_string(op.dst_capacity) + " bytes");
  }
}

// One pread per cache-sized chunk into this thread's bounce buffer, then the fused copy + CRC32C
// from there into dst (non-temporal stores: dst is not pulled through the cache).
uint32_t pread_via_bounce(int fd, uint64_t offset, uint64_t n, uint8_t* dst) {
  thread_local std::vector<uint8_t> bounce(kBounceBytes);
  uint32_t crc = 0;
  for (uint64_t done = 0; done < n; done += kBounceBytes) {
    const uint64_t m = std::min(kBounceBytes, n - done);
    pread_fully(fd, bounce.data(), m, offset + done);
    crc = crc32c_copy(dst + done, bounce.data(), m, crc);
  }
  return crc;
}

// pread straight into dst, each chunk checksummed right after, while it is still in the cache.
uint32_t pread_in_place(int fd, uint64_t offset, uint64_t n, uint8_t* dst, bool checksum) {
  uint32_t crc = 0;
  for (uint64_t done = 0; done < n; done += kBounceBytes) {
    const uint64_t m = std::min(kBounceBytes, n - done);
    pread_fully(fd, dst + done, m, offset + done);
    if (checksum) crc = crc32c(dst + done, m, crc);
  }
  return crc;
}

uint32_t pread_checksum(int fd, uint64_t offset, uint64_t n) {
  thread_local std::vector<uint8_t> scratch(kBounceBytes);
  uint32_t crc = 0;
  for (uint64_t done = 0; done < n; done += kBounceBytes) {
    const uint64_t m = std::min(kBounceBytes, n - done);
    pread_fully(fd, scratch.data(), m, offset + done);
    crc = crc32c(scratch.data(), m, crc);
  }
  return crc;
}

}  // namespace

ReadMethod read_method_from_name(const std::string& name) {
  if (name == "auto") return ReadMethod::kAuto;
  if (name == "map") return ReadMethod::kMap;
  if (name == "pread") return ReadMethod::kPread;
  throw std::invalid_argument("read method '" + name + "' is unknown; use 'auto', 'map' or 'pread'");
}

const char* read_method_name(ReadMethod method) {
  switch (method) {
    case ReadMethod::kMap:
      return "map";
    case ReadMethod::kPread:
      return "pread";
    default:
      return "auto";
  }
}

ReadMethod choose_read_method(int fd, uint64_t offset, uint64_t nbytes) {
  const FileView file(fd, ReadMethod::kAuto, offset, nbytes);
  return file.mapped() ? ReadMethod::kMap : ReadMethod::kPread;
}

std::vector<uint32_t> read_file_into(int fd, const std::vector<FileToMemOp>& ops, bool checksum, int threads,
                                     ReadMethod method) {
  check_capacities(ops);
  const auto probe = probe_range(ops, [](const FileToMemOp& op) { return op.file_offset; });
  const FileView file(fd, method, probe.first, probe.second);
  for (const auto& op : ops) file.check_range(op.file_offset, op.nbytes);
  if (file.mapped()) return copy_ops_mapped(file.data(), ops, checksum, threads);
  return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
    const auto& op = ops[p.op];
    uint8_t* dst = reinterpret_cast<uint8_t*>(op.dst_address) + p.offset;
    const uint64_t offset = op.file_offset + p.offset;
    if (checksum && p.nbytes >= kBounceMin) return pread_via_bounce(fd, offset, p.nbytes, dst);
    return pread_in_place(fd, offset, p.nbytes, dst, checksum);
  });
}

std::vector<uint32_t> checksum_file_ranges(int fd, const std::vector<RangeOp>& ops, int threads, ReadMethod method) {
  const auto probe = probe_range(ops, [](const RangeOp& op) { return op.offset; });
  const FileView file(fd, method, probe.first, probe.second);
  for (const auto& op : ops) file.check_range(op.offset, op.nbytes);
  if (file.mapped()) {
    install_fault_guard();
    return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
      return copy_mapped(file.data(), ops[p.op].offset + p.offset, p.nbytes, nullptr, true);
    });
  }
  return run_pieces(lengths_of(ops), threads,
                    [&](const Piece& p) { return pread_checksum(fd, ops[p.op].offset + p.offset, p.nbytes); });
}

std::vector<uint32_t> read_buffer_into(ShmBuffer& buffer, const std::vector<FileToMemOp>& ops, bool checksum,
                                       int threads) {
  std::shared_lock<std::shared_mutex> guard(buffer.mapping_lock());
  buffer.check_open();
  check_capacities(ops);
  const uint64_t size = buffer.size();
  for (const auto& op : ops) {
    if (op.file_offset > size || op.nbytes > size - op.file_offset)
      throw std::out_of_range("a read of " + std::to_string(op.nbytes) + " bytes at offset " +
                              std::to_string(op.file_offset) + " overruns buffer " + buffer.path() + " of " +
                              std::to_string(size) + " bytes");
  }
  // The mapping may outlast the file's end (truncated by someone else): the same check as a file read.
  const FileView file(buffer.fd(), ReadMethod::kPread, 0, 0);
  for (const auto& op : ops) file.check_range(op.file_offset, op.nbytes);
  return copy_ops_mapped(buffer.data(), ops, checksum, threads);
}

}  // namespace flashpoint
