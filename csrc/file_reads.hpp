// Reading byte ranges of a file into memory, checksummed on the way: the load's copy.
//
// Two ways, chosen per call by what the file's pages cost to map (ReadMethod::kAuto):
// - kMap: copy from a read-only mapping of the file, each 64 bytes loaded once, folded into the
//   CRC32C and streamed into the destination. Used when the file's pages are huge, where filling
//   the mapping's page tables is almost free. A file truncated meanwhile raises SIGBUS on the pages
//   it lost; the copy runs guarded (fault_guard.hpp) and reports ShortReadError instead.
// - kPread: pread into a small per-thread buffer that stays in the CPU cache, then the same fused
//   copy + CRC32C from there into the destination (ranges under 256 KiB are pread straight into
//   the destination and checksummed from cache). Used for 4 KiB pages, where mapping a file costs
//   a page fault per 16 pages and a page-table entry per page, which cost more than the kernel's own
//   per-page work in pread on the host of 2026-12-03 but less on that of 2026-12-06: which is
//   cheaper depends on the host (docs/performance.md, "Core" and "Loads no longer bounce").
// A file this process already holds mapped and populated (a pool buffer it saved) is copied from
// that mapping instead, the kMap copy without the per-page cost: read_buffer_into.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pieces.hpp"
#include "shm_buffer.hpp"

namespace flashpoint {

enum class ReadMethod { kAuto, kMap, kPread };

// "auto", "map" or "pread"; throws std::invalid_argument for anything else.
ReadMethod read_method_from_name(const std::string& name);
const char* read_method_name(ReadMethod method);

// One read from a file into memory: bytes [file_offset, +nbytes) go to dst_address, whose
// memory holds dst_capacity bytes. The capacity comes from the destination itself (never from
// the file), so a read the file describes wrongly is refused instead of overrunning it.
struct FileToMemOp {
  uint64_t file_offset;
  uint64_t dst_address;
  uint64_t nbytes;
  uint64_t dst_capacity;
};

// Copies every op (one CRC32C each, 0 when checksum is false). Throws ShortReadError when a
// range lies past the end of the file, before any byte moves, or when the file shrinks during
// the copy; the destinations then hold undefined data.
std::vector<uint32_t> read_file_into(int fd, const std::vector<FileToMemOp>& ops, bool checksum, int threads,
                                     ReadMethod method = ReadMethod::kAuto);

// read_file_into from a buffer that maps the file (ops' file_offset is the buffer offset), while
// it stays mapped: the buffer's mapping lock is held shared for the whole call. A loaded object's
// pool buffer is mapped and populated already, so this copy pays no per-page kernel work. Throws
// std::out_of_range (before any byte moves) when an op overruns its destination or the buffer,
// std::runtime_error when the buffer is closed, ShortReadError as read_file_into.
std::vector<uint32_t> read_buffer_into(ShmBuffer& buffer, const std::vector<FileToMemOp>& ops, bool checksum,
                                       int threads);

// CRC32C of each range of the file; same errors as read_file_into.
std::vector<uint32_t> checksum_file_ranges(int fd, const std::vector<RangeOp>& ops, int threads,
                                           ReadMethod method = ReadMethod::kAuto);

// What kAuto picks for reading [offset, offset+nbytes) of fd: kMap or kPread.
ReadMethod choose_read_method(int fd, uint64_t offset, uint64_t nbytes);

}  // namespace flashpoint
