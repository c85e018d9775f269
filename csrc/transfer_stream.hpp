// Moving object bytes over a Channel: CRC32C while the data is hot, sendfile when possible,
// receptions into warm mappings. The framing around them is in transfer_wire.
#pragma once

#include "transfer_temp_object.hpp"

namespace flashpoint {
namespace xfer {

// One CRC + one tag + one write per chunk (stays in L2); also the unit of authentication:
// chunk i is [i * kChunkBytes, min(size, (i + 1) * kChunkBytes)), followed by its tag.
constexpr size_t kChunkBytes = size_t(256) << 10;
// A receiver is woken once this many bytes are queued (or the rest of a chunk and its tag, if fewer).
constexpr size_t kReceiveLowWater = size_t(256) << 10;

// Receives size bytes into out, then the trailer; returns the CRC32C. TransferIntegrityError
// when a tag is wrong, TransferChecksumError when the trailer disagrees.
uint32_t receive_object(Channel& ch, TempObject& out, uint64_t size, std::vector<uint8_t>& buf);
// Sends [offset, offset+size) of file_fd, CRC32C of each chunk computed on the way; returns it.
uint32_t send_object(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                     std::vector<uint8_t>& buf);
// Sends [offset, offset+size) of file_fd whose CRC32C the caller already knows (still read: tags).
void send_object_known_crc(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                           std::vector<uint8_t>& buf);

}  // namespace xfer
}  // namespace flashpoint
