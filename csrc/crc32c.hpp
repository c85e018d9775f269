// CRC32C (Castagnoli) with hardware acceleration and a portable fallback.
//
// All functions use the standard conditioning (initial value and final xor of
// 0xFFFFFFFF), so crc32c(data, n, crc32c(a, na)) equals the CRC of a||data,
// exactly as zlib's crc32() continues a running checksum.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flashpoint {

// CRC32C of n bytes at data, continuing from crc (0 for a fresh checksum).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// CRC32C of A||B given crc_a = crc32c(A), crc_b = crc32c(B) and len_b = |B|.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Portable table-driven CRC32C, used as the reference in tests.
uint32_t crc32c_software(const void* data, size_t n, uint32_t crc = 0);

// Copies n bytes and returns the CRC32C of them, continuing from crc. Large copies run in
// one pass with non-temporal stores (the destination is not pulled into the cache): each
// 64 bytes are loaded once, folded into the CRC and stored.
uint32_t crc32c_copy(void* dst, const void* src, size_t n, uint32_t crc = 0);

// memcpy that uses non-temporal stores for large copies, like crc32c_copy without the CRC.
void copy_streaming(void* dst, const void* src, size_t n);

// Name of the implementation picked at start-up: "avx512-vpclmul", "sse4.2", "armv8-crc" or "software".
const char* crc32c_backend();

// Names of the implementations this CPU can run, fastest first.
std::vector<std::string> crc32c_backends();

// CRC32C with the named implementation (tests check each one this CPU can run against the
// software one); throws std::invalid_argument for a name this CPU cannot run.
uint32_t crc32c_using(const std::string& backend, const void* data, size_t n, uint32_t crc = 0);

}  // namespace flashpoint
