// Parallel copies with CRC32C computed in the same pass.
//
// Every function takes a list of operations, splits large ones into pieces,
// spreads the pieces over `threads` threads (the caller's thread included) and
// returns one CRC32C per operation (0 when checksumming is off). Large pieces are
// copied and checksummed in one pass (crc32c_copy: each 64 bytes loaded once);
// reads from a file copy from a read-only mapping of it the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shm_buffer.hpp"

namespace flashpoint {

// One copy from memory into a buffer: bytes [src, src+nbytes) go to buffer offset dst_offset.
struct MemToBufferOp {
  uint64_t src_address;
  uint64_t dst_offset;
  uint64_t nbytes;
};

// One read from a file into memory: bytes [file_offset, +nbytes) go to dst_address, whose
// memory holds dst_capacity bytes. The capacity comes from the destination itself (never from
// the file), so a read the file describes wrongly is refused instead of overrunning it.
struct FileToMemOp {
  uint64_t file_offset;
  uint64_t dst_address;
  uint64_t nbytes;
  uint64_t dst_capacity;
};

// A byte range [offset, offset+nbytes) of a file or a buffer.
struct RangeOp {
  uint64_t offset;
  uint64_t nbytes;
};

// streaming=false makes plain memcpy copies (no non-temporal stores): the benchmarks' reference.
std::vector<uint32_t> copy_into_buffer(ShmBuffer& buffer, const std::vector<MemToBufferOp>& ops, bool checksum,
                                       int threads, bool streaming = true);

std::vector<uint32_t> read_file_into(int fd, const std::vector<FileToMemOp>& ops, bool checksum, int threads);

std::vector<uint32_t> checksum_file_ranges(int fd, const std::vector<RangeOp>& ops, int threads);

std::vector<uint32_t> checksum_buffer_ranges(ShmBuffer& buffer, const std::vector<RangeOp>& ops, int threads);

}  // namespace flashpoint
