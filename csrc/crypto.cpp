// libcrypto wrappers of the transfer protocol (see crypto.hpp).
#include "crypto.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <algorithm>
#include <climits>
#include <string>

namespace flashpoint {
namespace {

// Largest piece handed to one libcrypto call whose length is an int.
constexpr size_t kMaxPiece = INT_MAX / 2;

// Throws CryptoError naming what failed and libcrypto's first queued reason; empties the queue.
[[noreturn]] void fail(const char* what) {
  const unsigned long code = ERR_get_error();
  char reason[256] = "no reason given";
  if (code != 0) ERR_error_string_n(code, reason, sizeof(reason));
  ERR_clear_error();
  throw CryptoError(std::string("OpenSSL's libcrypto failed to ") + what + " (" + reason +
                    "); nothing was sent or stored: check this node's OpenSSL 3 installation (libcrypto and its "
                    "default provider)");
}

void check(int ok, const char* what) {
  if (ok != 1) fail(what);
}

// Fetched once per process: an implicit fetch at every context set-up costs a name look-up each time.
const EVP_CIPHER* aes_256_gcm() {
  static EVP_CIPHER* const cipher = EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr);
  if (!cipher) fail("find AES-256-GCM");
  return cipher;
}

EVP_MAC* hmac_algorithm() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (!mac) fail("find HMAC");
  return mac;
}

}  // namespace

Gmac::Gmac(const uint8_t* key) : ctx_(nullptr) {
  const EVP_CIPHER* cipher = aes_256_gcm();
  ctx_ = EVP_CIPHER_CTX_new();
  if (!ctx_) fail("allocate an AES-256-GCM context");
  if (EVP_EncryptInit_ex2(ctx_, cipher, key, nullptr, nullptr) != 1) {
    EVP_CIPHER_CTX_free(ctx_);
    fail("set an AES-256-GCM key");
  }
}

Gmac::~Gmac() { EVP_CIPHER_CTX_free(ctx_); }

void Gmac::begin(const uint8_t* nonce) {
  // Only the IV is new: the key schedule stays, and the GHASH state starts over.
  check(EVP_EncryptInit_ex2(ctx_, nullptr, nullptr, nonce, nullptr), "set an AES-256-GCM nonce");
}

void Gmac::update(const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const int piece = static_cast<int>(std::min(n, kMaxPiece));
    int out_len = 0;
    // No output buffer: the bytes are additional authenticated data, nothing is encrypted.
    check(EVP_EncryptUpdate(ctx_, nullptr, &out_len, p, piece), "add data to an AES-256-GCM tag");
    p += piece;
    n -= static_cast<size_t>(piece);
  }
}

GmacTag Gmac::finish() {
  unsigned char none[16];
  int out_len = 0;
  GmacTag tag;
  check(EVP_EncryptFinal_ex(ctx_, none, &out_len), "finish an AES-256-GCM tag");
  check(EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, static_cast<int>(tag.size()), tag.data()),
        "read an AES-256-GCM tag");
  return tag;
}

HmacSha256::HmacSha256(const void* key, size_t key_len) : ctx_(nullptr) {
  EVP_MAC* mac = hmac_algorithm();
  ctx_ = EVP_MAC_CTX_new(mac);
  if (!ctx_) fail("allocate an HMAC context");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  // A null key would mean "keep the previous key": an empty key is passed as a valid pointer.
  static const unsigned char kEmptyKey[1] = {0};
  const unsigned char* k = key_len ? static_cast<const unsigned char*>(key) : kEmptyKey;
  if (EVP_MAC_init(ctx_, k, key_len, params) != 1) {
    EVP_MAC_CTX_free(ctx_);
    fail("set an HMAC-SHA256 key");
  }
}

HmacSha256::~HmacSha256() { EVP_MAC_CTX_free(ctx_); }

void HmacSha256::update(const void* data, size_t n) {
  if (n) check(EVP_MAC_update(ctx_, static_cast<const unsigned char*>(data), n), "add data to an HMAC-SHA256");
}

Digest256 HmacSha256::finish() {
  Digest256 d;
  size_t out_len = 0;
  check(EVP_MAC_final(ctx_, d.data(), &out_len, d.size()), "finish an HMAC-SHA256");
  if (out_len != d.size()) fail("produce a 32-byte HMAC-SHA256");
  return d;
}

Digest256 hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len) {
  HmacSha256 h(key, key_len);
  h.update(msg, msg_len);
  return h.finish();
}

void random_bytes(void* buf, size_t n) {
  unsigned char* p = static_cast<unsigned char*>(buf);
  while (n > 0) {
    const int piece = static_cast<int>(std::min(n, kMaxPiece));
    check(RAND_bytes(p, piece), "draw random bytes");
    p += piece;
    n -= static_cast<size_t>(piece);
  }
}

bool constant_time_equal(const void* a, const void* b, size_t n) { return CRYPTO_memcmp(a, b, n) == 0; }

void secure_zero(void* p, size_t n) { OPENSSL_cleanse(p, n); }

const char* crypto_library() { return OpenSSL_version(OPENSSL_VERSION); }

}  // namespace flashpoint
