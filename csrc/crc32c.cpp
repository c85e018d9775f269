// CRC32C implementation.
//
// Fastest first: on x86 with AVX-512 and VPCLMULQDQ, the data is folded 256
// bytes at a time with carry-less multiplies (four 512-bit accumulators, each
// holding four 128-bit remainders), about 32 bytes per cycle, so a copy that
// checksums what it moves stays bound by memory, not by the checksum. The
// crc32-instruction paths (SSE4.2, ARMv8) run three independent CRC streams
// over three adjacent lanes of a block: the instruction has a latency of about
// three cycles but a throughput of one per cycle, so interleaving triples the
// speed (about 8 bytes per cycle). The lane CRCs are merged by multiplying with
// x^(8*lane) mod P, done with four byte-indexed tables precomputed for that
// fixed lane length.
//
// Folding, in the reflected bit order CRC32C uses (bit 0 of byte 0 is the
// highest power): a 128-bit remainder A = H*x^64 + L that stands F bits before
// the next 128 bits B of the message is replaced by
//   clmul(H, x^(F+31) mod P) ^ clmul(L, x^(F-33) mod P) ^ B,
// which is congruent to A*x^F + B mod P (a reflected carry-less product gains
// one factor x, the constants' 32-bit form another x^32). The final 128-bit
// remainder is a 16-byte message with the same CRC as everything folded into
// it, so the crc32 instruction finishes it and continues with the tail.
#include "crc32c.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#include <nmmintrin.h>
#define FLASHPOINT_X86 1
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define FLASHPOINT_ARM 1
#endif

namespace flashpoint {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
constexpr size_t kLane = 4096;           // bytes per interleaved lane

// a * b mod P in the reflected bit order (bit 31 is x^0).
uint32_t gf2_multiply(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 0x80000000u; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

struct Tables {
  // Slicing-by-8 tables for the software path.
  uint32_t slice[8][256];
  // x^(2^k) mod P for k = 0..66, used to build x^(8n) for any 64-bit n (k runs from 3 to 66).
  uint32_t x_pow2[67];
  // Multiplication by x^(8*kLane) mod P, split by input byte.
  uint32_t lane_shift[4][256];

  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      slice[0][b] = c;
    }
    for (int t = 1; t < 8; ++t)
      for (uint32_t b = 0; b < 256; ++b)
        slice[t][b] = (slice[t - 1][b] >> 8) ^ slice[0][slice[t - 1][b] & 0xFF];

    uint32_t p = 0x40000000u;  // x^1
    x_pow2[0] = p;
    for (int k = 1; k < 67; ++k) x_pow2[k] = p = gf2_multiply(p, p);

    const uint32_t lane_constant = x_pow_8n(kLane);
    for (int byte = 0; byte < 4; ++byte)
      for (uint32_t b = 0; b < 256; ++b)
        lane_shift[byte][b] = gf2_multiply(b << (8 * byte), lane_constant);
  }

  // x^(8n) mod P.
  uint32_t x_pow_8n(uint64_t n) const {
    uint32_t result = 0x80000000u;  // x^0
    for (int k = 3; n != 0; n >>= 1, ++k)
      if (n & 1) result = gf2_multiply(x_pow2[k], result);
    return result;
  }

  // x^n mod P for a bit count n < 2^63 (the folding constants need powers that are not multiples of 8).
  uint32_t x_pow(uint64_t n) const {
    uint32_t result = 0x80000000u;  // x^0
    for (int k = 0; n != 0; n >>= 1, ++k)
      if (n & 1) result = gf2_multiply(x_pow2[k], result);
    return result;
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// Raw register update (no conditioning), software slicing-by-8.
uint32_t crc_raw_software(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t.slice[7][word & 0xFF] ^ t.slice[6][(word >> 8) & 0xFF] ^
          t.slice[5][(word >> 16) & 0xFF] ^ t.slice[4][(word >> 24) & 0xFF] ^
          t.slice[3][(word >> 32) & 0xFF] ^ t.slice[2][(word >> 40) & 0xFF] ^
          t.slice[1][(word >> 48) & 0xFF] ^ t.slice[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xFF];
  return crc;
}

inline uint32_t shift_one_lane(uint32_t crc) {
  const Tables& t = tables();
  return t.lane_shift[0][crc & 0xFF] ^ t.lane_shift[1][(crc >> 8) & 0xFF] ^
         t.lane_shift[2][(crc >> 16) & 0xFF] ^ t.lane_shift[3][crc >> 24];
}

// CRC of lanes A||B||C (each kLane bytes) from their three raw registers.
inline uint32_t combine_lanes(uint32_t a, uint32_t b, uint32_t c) { return shift_one_lane(shift_one_lane(a) ^ b) ^ c; }

#if FLASHPOINT_X86
__attribute__((target("sse4.2"))) uint32_t crc_raw_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  while (n >= 3 * kLane) {
    uint64_t a = crc, b = 0, c = 0;
    const uint8_t* pa = p;
    const uint8_t* pb = p + kLane;
    const uint8_t* pc = p + 2 * kLane;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t wa, wb, wc;
      std::memcpy(&wa, pa + i, 8);
      std::memcpy(&wb, pb + i, 8);
      std::memcpy(&wc, pc + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = combine_lanes(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c));
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  uint64_t c64 = crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  crc = static_cast<uint32_t>(c64);
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

bool cpu_has_sse42() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx & bit_SSE4_2) != 0;
}

bool cpu_has_avx2() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (ebx & bit_AVX2) != 0;
}

// One pass over the source: every 32 bytes are loaded once, folded into one of three
// interleaved CRC streams and written with a non-temporal store, so the destination
// costs no cache fills and the checksum no second trip to memory. dst must be 32-byte
// aligned and n a multiple of 3 * kLane; returns the raw register.
__attribute__((target("sse4.2,avx2"))) uint32_t copy_crc_lanes_nt(uint8_t* dst, const uint8_t* src, size_t n,
                                                                   uint32_t crc) {
  for (; n >= 3 * kLane; n -= 3 * kLane, src += 3 * kLane, dst += 3 * kLane) {
    uint64_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < kLane; i += 32) {
      const uint8_t* sa = src + i;
      const uint8_t* sb = src + kLane + i;
      const uint8_t* sc = src + 2 * kLane + i;
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa));
      const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb));
      const __m256i vc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc));
      for (size_t w = 0; w < 32; w += 8) {
        uint64_t wa, wb, wc;
        std::memcpy(&wa, sa + w, 8);
        std::memcpy(&wb, sb + w, 8);
        std::memcpy(&wc, sc + w, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        c = _mm_crc32_u64(c, wc);
      }
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), va);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + kLane + i), vb);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 2 * kLane + i), vc);
    }
    crc = combine_lanes(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c));
  }
  return crc;
}

__attribute__((target("avx2"))) void copy_nt(uint8_t* dst, const uint8_t* src, size_t n) {
  for (size_t i = 0; i < n; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
}

// ---- carry-less folding with AVX-512 VPCLMULQDQ (see the top of this file)

constexpr size_t kFoldBlock = 256;     // bytes per iteration: four 512-bit accumulators
constexpr size_t kFoldMin = 2 * kFoldBlock;  // below this, the crc32 instruction is as fast

// {x^(F+31), x^(F-33)} mod P for a fold over F bits: the multipliers of the high-power
// (low) and low-power (high) 64-bit halves of a 128-bit remainder.
// Each pair is repeated for the four 128-bit lanes of a 512-bit register.
struct FoldConstants {
  alignas(64) uint64_t over_2048[8];  // one 256-byte block ahead: each of the four accumulators
  alignas(64) uint64_t over_512[8];   // one 512-bit accumulator into the next
  alignas(16) uint64_t over_128[2];   // one 128-bit lane into the next
};

const FoldConstants& fold_constants() {
  static const FoldConstants constants = [] {
    const Tables& t = tables();
    FoldConstants c{};
    const auto pairs = [&](uint64_t bits, uint64_t* out, int lanes) {
      for (int lane = 0; lane < lanes; ++lane) {
        out[2 * lane] = t.x_pow(bits + 31);
        out[2 * lane + 1] = t.x_pow(bits - 33);
      }
    };
    pairs(2048, c.over_2048, 4);
    pairs(512, c.over_512, 4);
    pairs(128, c.over_128, 1);
    return c;
  }();
  return constants;
}

bool cpu_has_avx512_vpclmul() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const bool osxsave = (ecx & bit_OSXSAVE) != 0, pclmul = (ecx & bit_PCLMUL) != 0, sse42 = (ecx & bit_SSE4_2) != 0;
  if (!osxsave || !pclmul || !sse42) return false;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if ((ebx & bit_AVX512F) == 0 || (ecx & bit_VPCLMULQDQ) == 0) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  constexpr unsigned kZmmState = 0xE6;  // SSE, AVX, opmask, upper halves of ZMM0-15, ZMM16-31
  return (xcr0_lo & kZmmState) == kZmmState;
}

#define FLASHPOINT_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

// acc * x^F + next, reduced to 128 bits per lane (F is in the constants k).
FLASHPOINT_FOLD_TARGET inline __m512i fold_512(__m512i acc, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                   next, 0x96);  // three-way xor
}

FLASHPOINT_FOLD_TARGET inline __m128i fold_128(__m128i acc, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x00), _mm_clmulepi64_si128(acc, k, 0x11)), next);
}

// 64 bytes from src; with kCopy also streamed to dst, which is 64-byte aligned.
template <bool kCopy>
FLASHPOINT_FOLD_TARGET inline __m512i take_64(uint8_t* dst, const uint8_t* src) {
  const __m512i v = _mm512_loadu_si512(src);
  if (kCopy) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  return v;
}

// Loads 64 bytes from src, then streams the bytes `held` had (loaded 256 bytes earlier) to `to`;
// `held` keeps the new bytes, which are returned.
FLASHPOINT_FOLD_TARGET inline __m512i load_then_stream(__m512i& held, const uint8_t* src, __m512i* to) {
  const __m512i v = _mm512_loadu_si512(src);
  _mm512_stream_si512(to, held);
  held = v;
  return v;
}

// How fold_blocks treats what it loads.
enum class FoldMode {
  kChecksum,          // folded only
  kCopy,              // also streamed to dst, each 64 bytes right after its load
  kCopyLoadingAhead,  // also streamed to dst, each 64 bytes after the load 256 bytes further on
};

// Folds n bytes of src (n >= kFoldBlock, a multiple of 64) into the raw register crc and returns it.
// With a copy mode the same loads are also written to dst (64-byte aligned) with non-temporal
// stores: one pass over the source carries the copy and the checksum. kCopyLoadingAhead keeps the
// main loop's loads 256 bytes ahead of its stores: for the gaps it is used for (1-256, see
// stores_alias_loads) the nearest earlier store to the same low 12 address bits is then ~3.8 KiB
// back, as for a plain copy with dst 256 bytes before src, instead of the store just issued (the
// up to three 64-byte blocks after the main loop are copied in order). Where nothing aliases,
// kCopy stays the loop that was measured fastest.
template <FoldMode kMode>
FLASHPOINT_FOLD_TARGET uint32_t fold_blocks(uint8_t* dst, const uint8_t* src, size_t n, uint32_t crc) {
  constexpr bool kCopy = kMode == FoldMode::kCopy;
  constexpr bool kAhead = kMode == FoldMode::kCopyLoadingAhead;
  const FoldConstants& fc = fold_constants();
  const __m512i k2048 = _mm512_load_si512(fc.over_2048);
  const __m512i k512 = _mm512_load_si512(fc.over_512);
  const __m128i k128 = _mm_load_si128(reinterpret_cast<const __m128i*>(fc.over_128));

  // The running register enters as an xor into the first four bytes (reflected CRCs allow this).
  const __m512i crc_in = _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc)));
  __m512i x0, x1, x2, x3;
  size_t off = kFoldBlock;
  if constexpr (kAhead) {
    __m512i v0 = _mm512_loadu_si512(src);  // v0..v3: loaded, to be stored after the next loads
    __m512i v1 = _mm512_loadu_si512(src + 64);
    __m512i v2 = _mm512_loadu_si512(src + 128);
    __m512i v3 = _mm512_loadu_si512(src + 192);
    x0 = _mm512_xor_si512(v0, crc_in);
    x1 = v1;
    x2 = v2;
    x3 = v3;
    for (; off + kFoldBlock <= n; off += kFoldBlock) {
      auto* held = reinterpret_cast<__m512i*>(dst + off - kFoldBlock);
      x0 = fold_512(x0, k2048, load_then_stream(v0, src + off, held));
      x1 = fold_512(x1, k2048, load_then_stream(v1, src + off + 64, held + 1));
      x2 = fold_512(x2, k2048, load_then_stream(v2, src + off + 128, held + 2));
      x3 = fold_512(x3, k2048, load_then_stream(v3, src + off + 192, held + 3));
    }
    auto* last = reinterpret_cast<__m512i*>(dst + off - kFoldBlock);
    _mm512_stream_si512(last, v0);
    _mm512_stream_si512(last + 1, v1);
    _mm512_stream_si512(last + 2, v2);
    _mm512_stream_si512(last + 3, v3);
  } else {
    x0 = _mm512_xor_si512(take_64<kCopy>(dst, src), crc_in);
    x1 = take_64<kCopy>(dst + 64, src + 64);
    x2 = take_64<kCopy>(dst + 128, src + 128);
    x3 = take_64<kCopy>(dst + 192, src + 192);
    for (; off + kFoldBlock <= n; off += kFoldBlock) {
      x0 = fold_512(x0, k2048, take_64<kCopy>(dst + off, src + off));
      x1 = fold_512(x1, k2048, take_64<kCopy>(dst + off + 64, src + off + 64));
      x2 = fold_512(x2, k2048, take_64<kCopy>(dst + off + 128, src + off + 128));
      x3 = fold_512(x3, k2048, take_64<kCopy>(dst + off + 192, src + off + 192));
    }
  }
  __m512i x = fold_512(fold_512(fold_512(x0, k512, x1), k512, x2), k512, x3);
  for (; off + 64 <= n; off += 64) x = fold_512(x, k512, take_64<kCopy || kAhead>(dst + off, src + off));

  // Through memory rather than lane extracts: GCC's extract intrinsics trip its uninitialized-use
  // warnings in sanitizer builds, and this runs once per call.
  alignas(64) __m128i lanes[4];
  _mm512_store_si512(lanes, x);
  __m128i a = lanes[0];
  a = fold_128(a, k128, lanes[1]);
  a = fold_128(a, k128, lanes[2]);
  a = fold_128(a, k128, lanes[3]);
  // The 16 bytes left have the CRC of everything folded into them.
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(a)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(a, 1)));
  return static_cast<uint32_t>(c);
}

FLASHPOINT_FOLD_TARGET uint32_t crc_raw_vpclmul(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < kFoldMin) return crc_raw_sse42(crc, p, n);
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(p) & 63)) & 63;  // whole cache lines from here
  crc = crc_raw_sse42(crc, p, head);
  p += head;
  n -= head;
  const size_t body = n & ~size_t(63);
  crc = fold_blocks<FoldMode::kChecksum>(nullptr, p, body, crc);
  return crc_raw_sse42(crc, p + body, n - body);
}
#endif

#if FLASHPOINT_ARM
__attribute__((target("+crc"))) uint32_t crc_raw_armv8(uint32_t crc, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = __crc32cb(crc, *p++);
    --n;
  }
  while (n >= 3 * kLane) {
    uint32_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t wa, wb, wc;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + kLane + i, 8);
      std::memcpy(&wc, p + 2 * kLane + i, 8);
      a = __crc32cd(a, wa);
      b = __crc32cd(b, wb);
      c = __crc32cd(c, wc);
    }
    crc = combine_lanes(a, b, c);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    crc = __crc32cd(crc, w);
    p += 8;
    n -= 8;
  }
  while (n--) crc = __crc32cb(crc, *p++);
  return crc;
}

bool cpu_has_armv8_crc() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#endif

using RawFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);

struct Backend {
  RawFn fn;
  const char* name;
};

Backend pick_backend() {
  tables();  // build tables before any thread can race on them
#if FLASHPOINT_X86
  if (cpu_has_avx512_vpclmul()) {
    fold_constants();
    return {crc_raw_vpclmul, "avx512-vpclmul"};
  }
  if (cpu_has_sse42()) return {crc_raw_sse42, "sse4.2"};
#endif
#if FLASHPOINT_ARM
  if (cpu_has_armv8_crc()) return {crc_raw_armv8, "armv8-crc"};
#endif
  return {crc_raw_software, "software"};
}

const Backend& backend() {
  static const Backend b = pick_backend();
  return b;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  return ~backend().fn(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  return gf2_multiply(tables().x_pow_8n(len_b), crc_a) ^ crc_b;
}

uint32_t crc32c_software(const void* data, size_t n, uint32_t crc) {
  return ~crc_raw_software(~crc, static_cast<const uint8_t*>(data), n);
}

const char* crc32c_backend() { return backend().name; }

namespace {

std::vector<Backend> probe_backends() {
  std::vector<Backend> all;
#if FLASHPOINT_X86
  if (cpu_has_avx512_vpclmul()) all.push_back({crc_raw_vpclmul, "avx512-vpclmul"});
  if (cpu_has_sse42()) all.push_back({crc_raw_sse42, "sse4.2"});
#endif
#if FLASHPOINT_ARM
  if (cpu_has_armv8_crc()) all.push_back({crc_raw_armv8, "armv8-crc"});
#endif
  all.push_back({crc_raw_software, "software"});
  return all;
}

// Probed once: cpuid traps to the hypervisor in a VM and costs microseconds per call.
const std::vector<Backend>& available_backends() {
  static const std::vector<Backend> backends = probe_backends();
  return backends;
}

}  // namespace

std::vector<std::string> crc32c_backends() {
  std::vector<std::string> names;
  for (const Backend& b : available_backends()) names.emplace_back(b.name);
  return names;
}

uint32_t crc32c_using(const std::string& name, const void* data, size_t n, uint32_t crc) {
  backend();  // tables and constants are built
  for (const Backend& b : available_backends())
    if (name == b.name) return ~b.fn(~crc, static_cast<const uint8_t*>(data), n);
  throw std::invalid_argument("CRC32C backend '" + name + "' is not available on this CPU; choose one of " +
                              "crc32c_backends()");
}

namespace {

// Below this, cached stores are as fast (measured: from 16 KiB up, non-temporal stores into a
// destination that is not in the cache were 13-20% faster, 4-16 KiB even, 1-4 KiB 10% slower).
constexpr size_t kStreamMin = size_t(16) << 10;

#if FLASHPOINT_X86
bool can_stream() {
  static const bool ok = cpu_has_sse42() && cpu_has_avx2();
  return ok;
}

bool can_fold_copy() { return backend().fn == crc_raw_vpclmul; }

// Bytes to handle before dst is 32-byte aligned.
size_t head_until_aligned(const uint8_t* dst, size_t n) {
  const size_t misalign = reinterpret_cast<uintptr_t>(dst) & 31;
  return std::min(n, misalign ? 32 - misalign : size_t(0));
}
#endif

// A load waits for an earlier store whose address has the same low 12 bits (4K aliasing). When dst
// lies just past src modulo 4 KiB, every load of a loop that stores each block right after
// loading it hits a pending non-temporal store: 10-15x slower on the CPU of 2026-12-04 ((dst -
// src) mod 4096 from 32 to 128; fine from 192), no slower on that of 2026-12-06. Such copies keep
// their loads away from the stores they would alias: the AVX-512 fold loads 256 bytes ahead of its
// stores (fold_blocks; as fast as its plain loop, 2026-12-06); the SSE4.2 lanes copy goes through a
// cache-sized bounce 2 KiB away from both (~40% slower than its plain loop, 2026-12-06).
constexpr size_t kAliasWindow = 256;
constexpr size_t kAliasBounce = size_t(64) << 10;

bool stores_alias_loads(const uint8_t* dst, const uint8_t* src) {
  const size_t gap = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  return gap != 0 && gap <= kAliasWindow;
}

uint32_t crc32c_copy_direct(uint8_t* dst, const uint8_t* src, size_t n, uint32_t crc) {
#if FLASHPOINT_X86
  if (n >= kStreamMin && can_fold_copy()) {
    const size_t misalign = reinterpret_cast<uintptr_t>(dst) & 63;
    const size_t head = misalign ? 64 - misalign : 0;  // n >= kStreamMin leaves a long body after it
    std::memcpy(dst, src, head);
    uint32_t raw = crc_raw_sse42(~crc, src, head);
    const size_t body = (n - head) & ~size_t(63);
    raw = stores_alias_loads(dst, src) ? fold_blocks<FoldMode::kCopyLoadingAhead>(dst + head, src + head, body, raw)
                                       : fold_blocks<FoldMode::kCopy>(dst + head, src + head, body, raw);
    _mm_sfence();  // the streamed bytes are ordered before anything written after this call
    const size_t done = head + body;
    std::memcpy(dst + done, src + done, n - done);
    return ~crc_raw_sse42(raw, src + done, n - done);
  }
  if (n >= kStreamMin && can_stream()) {
    const size_t head = head_until_aligned(dst, n);
    std::memcpy(dst, src, head);
    uint32_t raw = crc_raw_sse42(~crc, src, head);
    const size_t body = (n - head) / (3 * kLane) * (3 * kLane);
    raw = copy_crc_lanes_nt(dst + head, src + head, body, raw);
    _mm_sfence();  // the streamed bytes are ordered before anything written after this call
    const size_t done = head + body;
    std::memcpy(dst + done, src + done, n - done);
    return ~crc_raw_sse42(raw, src + done, n - done);
  }
#endif
  std::memcpy(dst, src, n);
  return crc32c(dst, n, crc);
}

}  // namespace

uint32_t crc32c_copy(void* dst_void, const void* src_void, size_t n, uint32_t crc) {
  auto* dst = static_cast<uint8_t*>(dst_void);
  const auto* src = static_cast<const uint8_t*>(src_void);
  if (n < kStreamMin || can_fold_copy() || !stores_alias_loads(dst, src)) return crc32c_copy_direct(dst, src, n, crc);
  thread_local std::vector<uint8_t> bounce(kAliasBounce + 4096);
  // (bounce - src) mod 4096 == 2048, so (dst - bounce) mod 4096 is 2 KiB past the window too.
  const uintptr_t start = reinterpret_cast<uintptr_t>(bounce.data());
  uint8_t* staged = bounce.data() + ((reinterpret_cast<uintptr_t>(src) + 2048 - start) & 4095);
  for (size_t done = 0; done < n; done += kAliasBounce) {  // whole 4 KiB steps: the gaps stay
    const size_t m = std::min(kAliasBounce, n - done);
    std::memcpy(staged, src + done, m);
    crc = crc32c_copy_direct(dst + done, staged, m, crc);
  }
  return crc;
}

void copy_streaming(void* dst_void, const void* src_void, size_t n) {
  auto* dst = static_cast<uint8_t*>(dst_void);
  const auto* src = static_cast<const uint8_t*>(src_void);
#if FLASHPOINT_X86
  if (n >= kStreamMin && can_stream()) {
    const size_t head = head_until_aligned(dst, n);
    std::memcpy(dst, src, head);
    const size_t body = (n - head) / 32 * 32;
    copy_nt(dst + head, src + head, body);
    _mm_sfence();
    std::memcpy(dst + head + body, src + head + body, n - head - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace flashpoint
