// AES-256-GMAC (NIST SP 800-38D): AES-256-GCM with the whole message as additional data and
// no plaintext, so the tag is GHASH of the message under H = AES(K, 0^128), masked with
// AES(K, nonce || 0^31 || 1). The transfer protocol tags every message with it (docs/protocol.md).
//
// Backends compute the same tags: "openssl" (libcrypto's EVP AES-256-GCM, when the build found
// OpenSSL 3), and the built-in ones, chosen by what the CPU has at run time: "avx512-vpclmul"
// (AES-NI for the two AES blocks, 32 GHASH blocks per step with AVX-512 VPCLMULQDQ),
// "pclmul" (AES-NI and 8 blocks per step with PCLMULQDQ) and "portable" (C++ only, constant time:
// a table-free GHASH and an AES whose S-box look-ups read the whole table).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flashpoint {

constexpr size_t kGmacKeyBytes = 32;
constexpr size_t kGmacNonceBytes = 12;
constexpr size_t kGmacTagBytes = 16;
using GmacTag = std::array<uint8_t, kGmacTagBytes>;

// One key, any number of messages, each under a nonce that must never repeat for this key.
class Gmac {
 public:
  // backend "" is gmac_backend(); otherwise one of gmac_backends() (std::invalid_argument if not).
  explicit Gmac(const uint8_t* key, const std::string& backend = "");
  ~Gmac();
  Gmac(const Gmac&) = delete;
  Gmac& operator=(const Gmac&) = delete;

  void begin(const uint8_t* nonce);  // starts a message; forgets any unfinished one
  void update(const void* data, size_t n);
  GmacTag finish();
  const char* backend() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The backend a Gmac uses by default: the fastest this build and CPU have ("avx512-vpclmul"
// where the CPU has it: about twice OpenSSL 3.0's speed; else "openssl" when built with it).
const char* gmac_backend();
// Every backend this build and CPU can run, fastest (the default) first.
std::vector<std::string> gmac_backends();

}  // namespace flashpoint
