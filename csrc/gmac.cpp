// AES-256-GMAC: OpenSSL's EVP when built with it, and the built-in implementation of the same
// algorithm (see gmac.hpp).
//
// The built-in GHASH works in the POLYVAL domain of RFC 8452 (appendix A): a GCM block read as a
// big-endian 128-bit integer is a polynomial with bit i the coefficient of x^i, modulo
// Q = x^128 + x^127 + x^126 + x^121 + 1, and GHASH's multiplication by H becomes
// dot(a, H') = a * H' * x^-128 mod Q with H' = H * x. dot is a 256-bit carry-less product
// followed by a Montgomery reduction: the low 64 bits t0 are cancelled by adding t0 * Q, i.e.
// t0 * (x^57 + x^62 + x^63) (the constant 0xC2 << 56) at bit 64 and t0 itself at bit 128, then
// the next 64 bits the same way; the upper 128 bits are the result. Because dot is linear, k
// blocks are absorbed with one reduction: Y' = dot(Y + X1, H'_k) + dot(X2, H'_(k-1)) + ... +
// dot(Xk, H'_1), where H'_(j+1) = dot(H'_j, H').
#include "gmac.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>

#include "sha256.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define FLASHPOINT_GMAC_X86 1
#endif

#ifdef FLASHPOINT_HAVE_OPENSSL
#include <openssl/evp.h>
#endif

namespace flashpoint {

struct Gmac::Impl {
  virtual ~Impl() = default;
  virtual void begin(const uint8_t* nonce) = 0;
  virtual void update(const uint8_t* p, size_t n) = 0;
  virtual GmacTag finish() = 0;
  virtual const char* name() const = 0;
};

namespace {

// ---- AES-256 encryption (FIPS 197); only whole blocks of the key's own are encrypted here

struct SboxTable {
  uint8_t bytes[256];
  uint64_t words[32];  // the same bytes, 8 per word, for the constant-time look-up
};

uint8_t gf256_multiply(uint8_t a, uint8_t b) {  // table construction only (public data)
  uint8_t product = 0;
  for (int i = 0; i < 8; ++i) {
    if (b & 1) product ^= a;
    a = static_cast<uint8_t>((a << 1) ^ ((a & 0x80) ? 0x1b : 0));
    b >>= 1;
  }
  return product;
}

// S(b) = affine(b^-1): built from its definition rather than typed in.
const SboxTable& sbox_table() {
  static const SboxTable table = [] {
    SboxTable t{};
    for (int b = 0; b < 256; ++b) {
      uint8_t inverse = 0;
      for (int c = 1; c < 256 && b != 0; ++c)
        if (gf256_multiply(static_cast<uint8_t>(b), static_cast<uint8_t>(c)) == 1) inverse = static_cast<uint8_t>(c);
      uint8_t s = inverse;
      for (int r = 1; r <= 4; ++r) s ^= static_cast<uint8_t>((inverse << r) | (inverse >> (8 - r)));
      t.bytes[b] = static_cast<uint8_t>(s ^ 0x63);
    }
    for (int w = 0; w < 32; ++w) {
      uint64_t v = 0;
      for (int i = 7; i >= 0; --i) v = (v << 8) | t.bytes[8 * w + i];
      t.words[w] = v;
    }
    return t;
  }();
  return table;
}

// S-box look-up that reads every word of the table, so its timing and cache footprint do not
// depend on x (the key and the nonce-derived blocks are secret).
uint8_t sbox_ct(uint8_t x) {
  const SboxTable& t = sbox_table();
  const uint32_t want = x >> 3;
  uint64_t picked = 0;
  for (uint32_t w = 0; w < 32; ++w) {
    const uint64_t mask = 0 - static_cast<uint64_t>((((w ^ want) - 1) >> 31) & 1);  // all ones iff w == want
    picked |= t.words[w] & mask;
  }
  return static_cast<uint8_t>(picked >> (8 * (x & 7)));
}

struct Aes256 {
  uint8_t round_keys[15][16];
};

void aes256_expand_key(const uint8_t* key, Aes256& out) {
  uint8_t w[60][4];
  std::memcpy(w, key, 32);
  uint8_t rcon = 1;
  for (int i = 8; i < 60; ++i) {
    uint8_t t[4] = {w[i - 1][0], w[i - 1][1], w[i - 1][2], w[i - 1][3]};
    if (i % 8 == 0) {
      const uint8_t first = t[0];
      t[0] = static_cast<uint8_t>(sbox_ct(t[1]) ^ rcon);
      t[1] = sbox_ct(t[2]);
      t[2] = sbox_ct(t[3]);
      t[3] = sbox_ct(first);
      rcon = static_cast<uint8_t>((rcon << 1) ^ ((rcon & 0x80) ? 0x1b : 0));
    } else if (i % 8 == 4) {
      for (auto& b : t) b = sbox_ct(b);
    }
    for (int j = 0; j < 4; ++j) w[i][j] = static_cast<uint8_t>(w[i - 8][j] ^ t[j]);
  }
  std::memcpy(out.round_keys, w, sizeof(out.round_keys));
  secure_zero(w, sizeof(w));
}

inline uint8_t xtime(uint8_t b) { return static_cast<uint8_t>((b << 1) ^ (0x1b & (0 - (b >> 7)))); }

// The state is column-major as in FIPS 197: byte r + 4c is row r, column c.
void aes256_encrypt_portable(const Aes256& k, const uint8_t* in, uint8_t* out) {
  uint8_t s[16];
  for (int i = 0; i < 16; ++i) s[i] = in[i] ^ k.round_keys[0][i];
  for (int round = 1; round <= 14; ++round) {
    uint8_t t[16];
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < 4; ++r) t[r + 4 * c] = sbox_ct(s[r + 4 * ((c + r) % 4)]);  // SubBytes, ShiftRows
    if (round < 14) {
      for (int c = 0; c < 4; ++c) {  // MixColumns
        uint8_t* col = t + 4 * c;
        const uint8_t a0 = col[0], a1 = col[1], a2 = col[2], a3 = col[3], all = a0 ^ a1 ^ a2 ^ a3;
        col[0] = static_cast<uint8_t>(a0 ^ all ^ xtime(a0 ^ a1));
        col[1] = static_cast<uint8_t>(a1 ^ all ^ xtime(a1 ^ a2));
        col[2] = static_cast<uint8_t>(a2 ^ all ^ xtime(a2 ^ a3));
        col[3] = static_cast<uint8_t>(a3 ^ all ^ xtime(a3 ^ a0));
      }
    }
    for (int i = 0; i < 16; ++i) s[i] = t[i] ^ k.round_keys[round][i];
  }
  std::memcpy(out, s, 16);
  secure_zero(s, sizeof(s));
}

// ---- GHASH in the POLYVAL domain (see the top of this file)

struct U128 {
  uint64_t lo, hi;
};

inline uint64_t load_be64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}
inline void store_be64(uint8_t* p, uint64_t v) {
  for (int i = 7; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}
inline U128 from_block(const uint8_t* b) { return {load_be64(b + 8), load_be64(b)}; }
inline void to_block(const U128& v, uint8_t* b) {
  store_be64(b, v.hi);
  store_be64(b + 8, v.lo);
}

// Low 64 bits of the carry-less product, with integer multiplies: each operand is split into
// four sets of bits 4 apart, so a product of two sets has at most 16 terms per bit position and
// its carries (15 at most below bit 64) never reach the next position of the same set.
inline uint64_t clmul64_low(uint64_t x, uint64_t y) {
  constexpr uint64_t m0 = 0x1111111111111111ULL, m1 = m0 << 1, m2 = m0 << 2, m3 = m0 << 3;
  const uint64_t x0 = x & m0, x1 = x & m1, x2 = x & m2, x3 = x & m3;
  const uint64_t y0 = y & m0, y1 = y & m1, y2 = y & m2, y3 = y & m3;
  const uint64_t z0 = (x0 * y0) ^ (x1 * y3) ^ (x2 * y2) ^ (x3 * y1);
  const uint64_t z1 = (x0 * y1) ^ (x1 * y0) ^ (x2 * y3) ^ (x3 * y2);
  const uint64_t z2 = (x0 * y2) ^ (x1 * y1) ^ (x2 * y0) ^ (x3 * y3);
  const uint64_t z3 = (x0 * y3) ^ (x1 * y2) ^ (x2 * y1) ^ (x3 * y0);
  return (z0 & m0) | (z1 & m1) | (z2 & m2) | (z3 & m3);
}

inline uint64_t reverse64(uint64_t v) {
  v = ((v >> 1) & 0x5555555555555555ULL) | ((v & 0x5555555555555555ULL) << 1);
  v = ((v >> 2) & 0x3333333333333333ULL) | ((v & 0x3333333333333333ULL) << 2);
  v = ((v >> 4) & 0x0F0F0F0F0F0F0F0FULL) | ((v & 0x0F0F0F0F0F0F0F0FULL) << 4);
  return __builtin_bswap64(v);
}

// Full 128-bit carry-less product: the high half is the low half of the bit-reversed operands'
// product, reversed back (one position off, since the product has 127 bits).
inline U128 clmul64(uint64_t x, uint64_t y) {
  return {clmul64_low(x, y), reverse64(clmul64_low(reverse64(x), reverse64(y))) >> 1};
}

// t0 * (x^57 + x^62 + x^63): one Montgomery step's multiple of Q, shifts only.
inline U128 times_c2(uint64_t t) { return {(t << 57) ^ (t << 62) ^ (t << 63), (t >> 7) ^ (t >> 2) ^ (t >> 1)}; }

// dot(a, b) = a * b * x^-128 mod Q.
U128 dot_portable(const U128& a, const U128& b) {
  const U128 lo = clmul64(a.lo, b.lo), hi = clmul64(a.hi, b.hi);
  U128 mid = clmul64(a.lo ^ a.hi, b.lo ^ b.hi);  // Karatsuba
  mid.lo ^= lo.lo ^ hi.lo;
  mid.hi ^= lo.hi ^ hi.hi;
  uint64_t t0 = lo.lo, t1 = lo.hi ^ mid.lo, t2 = hi.lo ^ mid.hi, t3 = hi.hi;
  const U128 p = times_c2(t0);
  t1 ^= p.lo;
  t2 ^= p.hi ^ t0;
  const U128 q = times_c2(t1);
  t2 ^= q.lo;
  t3 ^= q.hi ^ t1;
  return {t2, t3};
}

// v * x mod Q.
U128 times_x(const U128& v) {
  const uint64_t carry = 0 - (v.hi >> 63);
  return {(v.lo << 1) ^ (carry & 1), ((v.hi << 1) | (v.lo >> 63)) ^ (carry & 0xC200000000000000ULL)};
}

constexpr int kPowers = 32;

struct GhashKey {
  // desc[32 - k] = H'_k: the powers from H'_32 down to H'_1, so block j of a 32-block step
  // (and block j of a 16- or 8-block step, from desc[16] or desc[24]) meets its power at the same index.
  alignas(64) U128 desc[kPowers];
};

void ghash_key_from(const uint8_t* h_block, GhashKey& k) {
  const U128 h = times_x(from_block(h_block));
  U128 power = h;
  k.desc[kPowers - 1] = power;
  for (int i = 2; i <= kPowers; ++i) {
    power = dot_portable(power, h);
    k.desc[kPowers - i] = power;
  }
}

// Absorbs n whole blocks into the accumulator.
using GhashBlocksFn = void (*)(U128& acc, const GhashKey& k, const uint8_t* p, size_t n);
using AesBlockFn = void (*)(const Aes256& k, const uint8_t* in, uint8_t* out);

void ghash_portable(U128& acc, const GhashKey& k, const uint8_t* p, size_t n) {
  const U128 h = k.desc[kPowers - 1];
  U128 y = acc;
  for (; n; --n, p += 16) {
    const U128 b = from_block(p);
    y.lo ^= b.lo;
    y.hi ^= b.hi;
    y = dot_portable(y, h);
  }
  acc = y;
}

#if FLASHPOINT_GMAC_X86

#define FLASHPOINT_PCLMUL_TARGET __attribute__((target("pclmul,ssse3,sse4.1")))
#define FLASHPOINT_VPCLMUL_TARGET __attribute__((target("avx512f,avx512bw,avx2,vpclmulqdq,pclmul,ssse3,sse4.1")))

__attribute__((target("aes,sse2"))) void aes256_encrypt_aesni(const Aes256& k, const uint8_t* in, uint8_t* out) {
  __m128i s = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(k.round_keys[0])));
  for (int r = 1; r < 14; ++r) s = _mm_aesenc_si128(s, _mm_loadu_si128(reinterpret_cast<const __m128i*>(k.round_keys[r])));
  s = _mm_aesenclast_si128(s, _mm_loadu_si128(reinterpret_cast<const __m128i*>(k.round_keys[14])));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), s);
}

// A block as loaded (byte 0 lowest) turned into its big-endian value.
FLASHPOINT_PCLMUL_TARGET inline __m128i byte_reverse_mask() {
  return _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

FLASHPOINT_PCLMUL_TARGET inline void multiply_add(__m128i a, __m128i h, __m128i& lo, __m128i& mid, __m128i& hi) {
  lo = _mm_xor_si128(lo, _mm_clmulepi64_si128(a, h, 0x00));
  hi = _mm_xor_si128(hi, _mm_clmulepi64_si128(a, h, 0x11));
  mid = _mm_xor_si128(mid, _mm_xor_si128(_mm_clmulepi64_si128(a, h, 0x01), _mm_clmulepi64_si128(a, h, 0x10)));
}

// [t1:t0] and [t3:t2] of a 256-bit product -> its dot reduction (two Montgomery steps).
FLASHPOINT_PCLMUL_TARGET inline __m128i montgomery_reduce(__m128i t01, __m128i t23) {
  const __m128i c2 = _mm_set_epi64x(0, static_cast<long long>(0xC200000000000000ULL));
  __m128i x = _mm_xor_si128(_mm_shuffle_epi32(t01, 0x4E), _mm_clmulepi64_si128(t01, c2, 0x00));
  x = _mm_xor_si128(_mm_shuffle_epi32(x, 0x4E), _mm_clmulepi64_si128(x, c2, 0x00));
  return _mm_xor_si128(t23, x);
}

FLASHPOINT_PCLMUL_TARGET inline __m128i reduce(__m128i lo, __m128i mid, __m128i hi) {
  return montgomery_reduce(_mm_xor_si128(lo, _mm_slli_si128(mid, 8)), _mm_xor_si128(hi, _mm_srli_si128(mid, 8)));
}

FLASHPOINT_PCLMUL_TARGET inline __m128i load_block(const uint8_t* p, __m128i reverse) {
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), reverse);
}

FLASHPOINT_PCLMUL_TARGET inline __m128i load_power(const GhashKey& k, int power) {
  return _mm_load_si128(reinterpret_cast<const __m128i*>(&k.desc[kPowers - power]));
}

// Eight blocks per reduction (the accumulator enters the first block's product, added last), then
// one at a time.
FLASHPOINT_PCLMUL_TARGET void ghash_pclmul(U128& acc, const GhashKey& k, const uint8_t* p, size_t n) {
  const __m128i reverse = byte_reverse_mask();
  __m128i h[8];
  for (int i = 0; i < 8; ++i) h[i] = load_power(k, 8 - i);  // block i of a step meets H'^(8-i)
  __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&acc));
  for (; n >= 8; n -= 8, p += 128) {
    __m128i lo = _mm_setzero_si128(), mid = _mm_setzero_si128(), hi = _mm_setzero_si128();
    for (int i = 7; i >= 1; --i) multiply_add(load_block(p + 16 * i, reverse), h[i], lo, mid, hi);
    multiply_add(_mm_xor_si128(load_block(p, reverse), y), h[0], lo, mid, hi);
    y = reduce(lo, mid, hi);
  }
  for (; n; --n, p += 16) {
    __m128i lo = _mm_setzero_si128(), mid = _mm_setzero_si128(), hi = _mm_setzero_si128();
    multiply_add(_mm_xor_si128(load_block(p, reverse), y), h[7], lo, mid, hi);
    y = reduce(lo, mid, hi);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&acc), y);
}

FLASHPOINT_VPCLMUL_TARGET inline __m512i xor3(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi64(a, b, c, 0x96);
}

// GCC's headers implement the lane shuffles below with a deliberately undefined pass-through
// operand, which its -Wmaybe-uninitialized reports inside the header; nothing here is uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Sum of the four 128-bit lanes.
FLASHPOINT_VPCLMUL_TARGET inline __m128i lane_sum(__m512i v) {
  v = _mm512_xor_si512(v, _mm512_shuffle_i64x2(v, v, 0x4E));  // + the other 256-bit half
  v = _mm512_xor_si512(v, _mm512_shuffle_i64x2(v, v, 0xB1));  // + the neighbouring lane
  return _mm512_castsi512_si128(v);
}

// The products of one register of four blocks with four powers, added to the accumulators.
FLASHPOINT_VPCLMUL_TARGET inline void multiply_add_4(__m512i d, __m512i h, __m512i& lo, __m512i& mid, __m512i& hi) {
  lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(d, h, 0x00));
  hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(d, h, 0x11));
  mid = xor3(mid, _mm512_clmulepi64_epi128(d, h, 0x01), _mm512_clmulepi64_epi128(d, h, 0x10));
}

FLASHPOINT_VPCLMUL_TARGET inline __m512i load_blocks_4(const uint8_t* p, __m512i reverse) {
  return _mm512_shuffle_epi8(_mm512_loadu_si512(p), reverse);
}

// Folds the 512-bit accumulators into the next accumulator value (one Montgomery reduction).
FLASHPOINT_VPCLMUL_TARGET inline __m128i reduce_4(__m512i lo, __m512i mid, __m512i hi) {
  const __m512i t01 = _mm512_xor_si512(lo, _mm512_bslli_epi128(mid, 8));
  const __m512i t23 = _mm512_xor_si512(hi, _mm512_bsrli_epi128(mid, 8));
  return montgomery_reduce(lane_sum(t01), lane_sum(t23));
}

// 32 blocks (eight 512-bit registers of four) per reduction, then 16, then as ghash_pclmul. The
// accumulator enters only the first block's product, which is added last: the reduction's
// latency, not the multiplier, bounds a step, so longer steps go faster.
FLASHPOINT_VPCLMUL_TARGET void ghash_vpclmul(U128& acc, const GhashKey& k, const uint8_t* p, size_t n) {
  if (n >= 16) {
    const __m512i reverse = _mm512_set_epi64(0x0001020304050607LL, 0x08090A0B0C0D0E0FLL, 0x0001020304050607LL,
                                             0x08090A0B0C0D0E0FLL, 0x0001020304050607LL, 0x08090A0B0C0D0E0FLL,
                                             0x0001020304050607LL, 0x08090A0B0C0D0E0FLL);
    __m512i h[8];
    for (int i = 0; i < 8; ++i) h[i] = _mm512_load_si512(&k.desc[4 * i]);  // H'_32..29, ..., H'_4..1
    __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&acc));
    for (; n >= 32; n -= 32, p += 512) {
      __m512i lo = _mm512_setzero_si512(), mid = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int i = 7; i >= 1; --i) multiply_add_4(load_blocks_4(p + 64 * i, reverse), h[i], lo, mid, hi);
      multiply_add_4(_mm512_xor_si512(load_blocks_4(p, reverse), _mm512_zextsi128_si512(y)), h[0], lo, mid, hi);
      y = reduce_4(lo, mid, hi);
    }
    if (n >= 16) {
      __m512i lo = _mm512_setzero_si512(), mid = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int i = 3; i >= 1; --i) multiply_add_4(load_blocks_4(p + 64 * i, reverse), h[4 + i], lo, mid, hi);
      multiply_add_4(_mm512_xor_si512(load_blocks_4(p, reverse), _mm512_zextsi128_si512(y)), h[4], lo, mid, hi);
      y = reduce_4(lo, mid, hi);
      n -= 16;
      p += 256;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&acc), y);
  }
  ghash_pclmul(acc, k, p, n);
}

#pragma GCC diagnostic pop

unsigned cpuid_reg(unsigned leaf, unsigned sub, int which) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return 0;
  return r[which];
}

bool cpu_has_aes_pclmul() {
  const unsigned ecx = cpuid_reg(1, 0, 2);
  return (ecx & bit_AES) && (ecx & bit_PCLMUL) && (ecx & bit_SSSE3) && (ecx & bit_SSE4_1);
}

bool cpu_has_avx512_vpclmul_bw() {
  if (!cpu_has_aes_pclmul() || !(cpuid_reg(1, 0, 2) & bit_OSXSAVE)) return false;
  const unsigned ebx = cpuid_reg(7, 0, 1), ecx = cpuid_reg(7, 0, 2);
  if (!(ebx & bit_AVX512F) || !(ebx & bit_AVX512BW) || !(ebx & bit_AVX2) || !(ecx & bit_VPCLMULQDQ)) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  constexpr unsigned kZmmState = 0xE6;  // SSE, AVX, opmask, upper halves of ZMM0-15, ZMM16-31
  return (xcr0_lo & kZmmState) == kZmmState;
}

#endif  // FLASHPOINT_GMAC_X86

// ---- the built-in backends

struct BuiltinBackend {
  const char* name;
  GhashBlocksFn blocks;
  AesBlockFn encrypt;
};

std::vector<BuiltinBackend> probe_builtin_backends() {
  std::vector<BuiltinBackend> all;
#if FLASHPOINT_GMAC_X86
  if (cpu_has_avx512_vpclmul_bw()) all.push_back({"avx512-vpclmul", ghash_vpclmul, aes256_encrypt_aesni});
  if (cpu_has_aes_pclmul()) all.push_back({"pclmul", ghash_pclmul, aes256_encrypt_aesni});
#endif
  all.push_back({"portable", ghash_portable, aes256_encrypt_portable});
  return all;
}

// Probed once (cpuid traps to the hypervisor in a VM); the S-box is built before any thread races on it.
const std::vector<BuiltinBackend>& builtin_backends() {
  static const std::vector<BuiltinBackend> backends = [] {
    sbox_table();
    return probe_builtin_backends();
  }();
  return backends;
}

class BuiltinGmac final : public Gmac::Impl {
 public:
  BuiltinGmac(const uint8_t* key, const BuiltinBackend& backend) : backend_(backend) {
    aes256_expand_key(key, aes_);
    uint8_t h[16] = {0};
    backend_.encrypt(aes_, h, h);
    ghash_key_from(h, ghash_);
    secure_zero(h, sizeof(h));
  }
  ~BuiltinGmac() override {
    secure_zero(&aes_, sizeof(aes_));
    secure_zero(&ghash_, sizeof(ghash_));
    secure_zero(mask_, sizeof(mask_));
  }

  void begin(const uint8_t* nonce) override {
    uint8_t j0[16];
    std::memcpy(j0, nonce, kGmacNonceBytes);
    j0[12] = j0[13] = j0[14] = 0;
    j0[15] = 1;
    backend_.encrypt(aes_, j0, mask_);
    acc_ = {0, 0};
    pending_ = 0;
    total_ = 0;
  }

  void update(const uint8_t* p, size_t n) override {
    total_ += n;
    if (pending_) {
      const size_t take = std::min(n, sizeof(partial_) - pending_);
      std::memcpy(partial_ + pending_, p, take);
      pending_ += take;
      p += take;
      n -= take;
      if (pending_ < sizeof(partial_)) return;
      backend_.blocks(acc_, ghash_, partial_, 1);
      pending_ = 0;
    }
    const size_t whole = n / 16;
    if (whole) backend_.blocks(acc_, ghash_, p, whole);
    pending_ = n - 16 * whole;
    std::memcpy(partial_, p + 16 * whole, pending_);
  }

  GmacTag finish() override {
    if (pending_) {
      std::memset(partial_ + pending_, 0, sizeof(partial_) - pending_);
      backend_.blocks(acc_, ghash_, partial_, 1);
      pending_ = 0;
    }
    uint8_t lengths[16];
    store_be64(lengths, total_ * 8);  // bits of additional data
    store_be64(lengths + 8, 0);       // bits of ciphertext: none
    backend_.blocks(acc_, ghash_, lengths, 1);
    uint8_t s[16];
    to_block(acc_, s);
    GmacTag tag;
    for (size_t i = 0; i < kGmacTagBytes; ++i) tag[i] = static_cast<uint8_t>(s[i] ^ mask_[i]);
    return tag;
  }

  const char* name() const override { return backend_.name; }

 private:
  BuiltinBackend backend_;
  Aes256 aes_;
  GhashKey ghash_;
  U128 acc_{0, 0};
  uint8_t mask_[16] = {0};  // AES(K, J0)
  uint8_t partial_[16] = {0};
  size_t pending_ = 0;
  uint64_t total_ = 0;
};

#ifdef FLASHPOINT_HAVE_OPENSSL

constexpr const char kOpenSslName[] = "openssl";

class OpenSslGmac final : public Gmac::Impl {
 public:
  explicit OpenSslGmac(const uint8_t* key) : ctx_(EVP_CIPHER_CTX_new()) {
    if (!ctx_) throw std::bad_alloc();
    if (EVP_EncryptInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, key, nullptr) != 1) {
      EVP_CIPHER_CTX_free(ctx_);
      throw std::runtime_error("OpenSSL AES-256-GCM key setup failed (libcrypto without its default provider?)");
    }
  }
  ~OpenSslGmac() override { EVP_CIPHER_CTX_free(ctx_); }

  void begin(const uint8_t* nonce) override {  // the key schedule stays, only the IV is new
    if (EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, nonce) != 1)
      throw std::runtime_error("OpenSSL AES-256-GCM nonce setup failed");
  }

  void update(const uint8_t* p, size_t n) override {
    while (n > 0) {
      const int piece = static_cast<int>(std::min<size_t>(n, INT_MAX / 2));
      int out_len = 0;
      if (EVP_EncryptUpdate(ctx_, nullptr, &out_len, p, piece) != 1)
        throw std::runtime_error("OpenSSL AES-256-GCM additional data update failed");
      p += piece;
      n -= static_cast<size_t>(piece);
    }
  }

  GmacTag finish() override {
    unsigned char none[16];
    int out_len = 0;
    GmacTag tag;
    if (EVP_EncryptFinal_ex(ctx_, none, &out_len) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, static_cast<int>(tag.size()), tag.data()) != 1)
      throw std::runtime_error("OpenSSL AES-256-GCM tag computation failed");
    return tag;
  }

  const char* name() const override { return kOpenSslName; }

 private:
  EVP_CIPHER_CTX* ctx_;
};

#endif  // FLASHPOINT_HAVE_OPENSSL

}  // namespace

namespace {
// Fastest first, as measured on one core (256 KiB messages, OpenSSL 3.0 on an AVX-512 CPU):
// avx512-vpclmul about twice OpenSSL's speed, pclmul about 0.7x, portable about 0.05x.
std::vector<std::string> rank_backends() {
  std::vector<std::string> names;
  const std::vector<BuiltinBackend>& builtin = builtin_backends();
  size_t next = 0;
  if (std::string(builtin.front().name) == "avx512-vpclmul") names.emplace_back(builtin[next++].name);
#ifdef FLASHPOINT_HAVE_OPENSSL
  names.emplace_back(kOpenSslName);
#endif
  for (; next < builtin.size(); ++next) names.emplace_back(builtin[next].name);
  return names;
}

const std::vector<std::string>& ranked_backends() {
  static const std::vector<std::string> names = rank_backends();
  return names;
}
}  // namespace

const char* gmac_backend() { return ranked_backends().front().c_str(); }

std::vector<std::string> gmac_backends() { return ranked_backends(); }

Gmac::Gmac(const uint8_t* key, const std::string& backend) {
  const std::string want = backend.empty() ? std::string(gmac_backend()) : backend;
#ifdef FLASHPOINT_HAVE_OPENSSL
  if (want == kOpenSslName) {
    impl_.reset(new OpenSslGmac(key));
    return;
  }
#endif
  for (const BuiltinBackend& b : builtin_backends()) {
    if (want == b.name) {
      impl_.reset(new BuiltinGmac(key, b));
      return;
    }
  }
  throw std::invalid_argument("GMAC backend '" + want + "' is not available in this build or on this CPU; choose one of " +
                              "gmac_backends()");
}

Gmac::~Gmac() = default;
void Gmac::begin(const uint8_t* nonce) { impl_->begin(nonce); }
void Gmac::update(const void* data, size_t n) {
  if (n) impl_->update(static_cast<const uint8_t*>(data), n);
}
GmacTag Gmac::finish() { return impl_->finish(); }
const char* Gmac::backend() const { return impl_->name(); }

}  // namespace flashpoint
