// Parallel copies into a buffer, with CRC32C computed in the same pass.
//
// Every function takes a list of operations, splits large ones into pieces,
// spreads the pieces over `threads` threads (the caller's thread included) and
// returns one CRC32C per operation (0 when checksumming is off). Large pieces are
// copied and checksummed in one pass (crc32c_copy: each 64 bytes loaded once).
// Reads from a file into memory are in file_reads.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pieces.hpp"
#include "shm_buffer.hpp"

namespace flashpoint {

// One copy from memory into a buffer: bytes [src, src+nbytes) go to buffer offset dst_offset.
struct MemToBufferOp {
  uint64_t src_address;
  uint64_t dst_offset;
  uint64_t nbytes;
};

std::vector<uint32_t> copy_into_buffer(ShmBuffer& buffer, const std::vector<MemToBufferOp>& ops, bool checksum,
                                       int threads);

std::vector<uint32_t> checksum_buffer_ranges(ShmBuffer& buffer, const std::vector<RangeOp>& ops, int threads);

}  // namespace flashpoint
