// The cryptographic primitives of the transfer protocol, all from OpenSSL's libcrypto (3.0 or
// later; the build requires it): AES-256-GMAC tags (EVP AES-256-GCM with the message as additional
// data and no plaintext), HMAC-SHA256 (EVP_MAC), random bytes (RAND_bytes), constant-time
// comparison (CRYPTO_memcmp) and wiping of key material (OPENSSL_cleanse). Nothing here is our own
// cryptography: these are thin wrappers that own libcrypto's contexts and check every return value.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "transfer.hpp"

// libcrypto's context types, declared here so that users of this header need not include OpenSSL's.
typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;
typedef struct evp_mac_ctx_st EVP_MAC_CTX;

namespace flashpoint {

// A libcrypto call failed (no default provider, out of memory, no entropy): the operation stops
// here rather than go on with a wrong tag or a weak nonce. Python: TransferError.
class CryptoError : public TransferError {
 public:
  using TransferError::TransferError;
};

constexpr size_t kGmacKeyBytes = 32;
constexpr size_t kGmacNonceBytes = 12;
constexpr size_t kGmacTagBytes = 16;
using GmacTag = std::array<uint8_t, kGmacTagBytes>;
using Digest256 = std::array<uint8_t, 32>;

// AES-256-GMAC (NIST SP 800-38D): one key, any number of messages, each under a nonce that must
// never repeat for this key. One libcrypto context for the object's life: a message only sets a
// new IV (the key schedule stays), so tagging allocates nothing. Not for use by two threads at once.
class Gmac {
 public:
  explicit Gmac(const uint8_t* key);  // kGmacKeyBytes
  ~Gmac();
  Gmac(const Gmac&) = delete;
  Gmac& operator=(const Gmac&) = delete;

  void begin(const uint8_t* nonce);  // kGmacNonceBytes; starts a message, forgets any unfinished one
  void update(const void* data, size_t n);
  GmacTag finish();

 private:
  EVP_CIPHER_CTX* ctx_;
};

// Incremental HMAC-SHA256 (RFC 2104): HMAC(K, m1 || m2 || ...) with update(m1), update(m2), ...
class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t key_len);
  ~HmacSha256();
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;

  void update(const void* data, size_t n);
  Digest256 finish();  // once; the object is not updated afterwards

 private:
  EVP_MAC_CTX* ctx_;
};

Digest256 hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len);

// Fills buf with n bytes from libcrypto's CSPRNG; CryptoError if it cannot (never weaker bytes).
void random_bytes(void* buf, size_t n);

// Compares n bytes in time that does not depend on where they differ.
bool constant_time_equal(const void* a, const void* b, size_t n);

// Wipes memory in a way the compiler cannot drop (for key material).
void secure_zero(void* p, size_t n);

// The libcrypto this process runs, e.g. "OpenSSL 3.0.19 27 Jan 2026" (for reports and logs).
const char* crypto_library();

}  // namespace flashpoint
