// Splitting a list of operations into pieces and running them on several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace flashpoint {

constexpr uint64_t kPieceBytes = uint64_t(4) << 20;  // large operations are split into pieces this big

// A byte range [offset, offset+nbytes) of a file or a buffer.
struct RangeOp {
  uint64_t offset;
  uint64_t nbytes;
};

// One piece of operation `op`: bytes [offset, offset+nbytes) of it.
struct Piece {
  size_t op;
  uint64_t offset;
  uint64_t nbytes;
  uint32_t crc;
};

// Runs piece_fn over the pieces of operations of the given lengths on up to `threads` threads
// (the caller's included; one thread for small totals) and returns one CRC32C per operation,
// folded from its pieces' results. The first exception of any piece stops the others and is
// rethrown here.
std::vector<uint32_t> run_pieces(const std::vector<uint64_t>& lengths, int threads,
                                 const std::function<uint32_t(const Piece&)>& piece_fn);

template <typename Op>
std::vector<uint64_t> lengths_of(const std::vector<Op>& ops) {
  std::vector<uint64_t> lengths;
  lengths.reserve(ops.size());
  for (const Op& op : ops) lengths.push_back(op.nbytes);
  return lengths;
}

}  // namespace flashpoint
