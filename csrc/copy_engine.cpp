#include "copy_engine.hpp"

#include <shared_mutex>
#include <stdexcept>
#include <string>

#include "crc32c.hpp"

namespace flashpoint {
namespace {

void check_in_bounds(const ShmBuffer& buffer, uint64_t offset, uint64_t nbytes) {
  if (offset > buffer.size() || nbytes > buffer.size() - offset)
    throw std::out_of_range("range [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
                            ") is outside buffer " + buffer.path() + " of " + std::to_string(buffer.size()) +
                            " bytes");
}

}  // namespace

std::vector<uint32_t> copy_into_buffer(ShmBuffer& buffer, const std::vector<MemToBufferOp>& ops, bool checksum,
                                       int threads) {
  std::shared_lock<std::shared_mutex> guard(buffer.mapping_lock());
  buffer.check_open();
  if (!buffer.writable()) throw std::invalid_argument("buffer " + buffer.path() + " is read-only");
  for (const auto& op : ops) check_in_bounds(buffer, op.dst_offset, op.nbytes);
  uint8_t* base = buffer.data();
  return run_pieces(lengths_of(ops), threads, [&](const Piece& p) {
    const auto& op = ops[p.op];
    const uint8_t* src = reinterpret_cast<const uint8_t*>(op.src_address) + p.offset;
    uint8_t* dst = base + op.dst_offset + p.offset;
    if (!checksum) {
      copy_streaming(dst, src, p.nbytes);
      return uint32_t(0);
    }
    return crc32c_copy(dst, src, p.nbytes);
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
