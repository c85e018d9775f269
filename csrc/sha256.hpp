// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), written here so the extension needs no
// crypto library (CI machines may lack OpenSSL headers). Used by the transfer service's
// handshake; the RFC 4231 test vectors run against it in tests/test_transfer_service.py.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace flashpoint {

using Digest256 = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Digest256 finish();  // the object must not be updated afterwards

 private:
  void compress(const uint8_t* block);
  uint32_t state_[8];
  uint64_t total_bytes_ = 0;
  uint8_t block_[64];
  size_t block_fill_ = 0;
};

// Incremental HMAC-SHA256: HMAC(K, m1 || m2 || ...) with update(m1), update(m2), ...
class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t key_len);
  void update(const void* data, size_t n) { inner_.update(data, n); }
  Digest256 finish();

 private:
  Sha256 inner_;
  uint8_t outer_pad_[64];
};

Digest256 sha256(const void* data, size_t n);
Digest256 hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len);

// Compares n bytes in time that does not depend on where they differ.
bool constant_time_equal(const void* a, const void* b, size_t n);

// Wipes memory in a way the compiler cannot drop (for key material).
void secure_zero(void* p, size_t n);

}  // namespace flashpoint
