// Session keys and tags of the transfer protocol (see transfer_mac.hpp).
#include "transfer_mac.hpp"

#include <cstring>
#include <stdexcept>

#include "transfer.hpp"

#ifdef FLASHPOINT_HAVE_OPENSSL
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#endif

namespace flashpoint {
namespace xfer {
namespace {

constexpr const char kKeyLabelClientToServer[] = "mlfp-xfer-v2 key client->server";
constexpr const char kKeyLabelServerToClient[] = "mlfp-xfer-v2 key server->client";

Digest256 derive_key(const std::string& secret, const char* label, const uint8_t* nonce_c, const uint8_t* nonce_s) {
  HmacSha256 h(secret.data(), secret.size());
  h.update(label, std::strlen(label));
  h.update(nonce_c, 32);
  h.update(nonce_s, 32);
  return h.finish();
}

}  // namespace

#ifdef FLASHPOINT_HAVE_OPENSSL

const char* mac_backend() { return "openssl"; }

namespace {
EVP_MAC* hmac_algorithm() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);  // thread-safe, never freed
  if (!mac) throw std::runtime_error("OpenSSL provides no HMAC (libcrypto without its default provider?)");
  return mac;
}
}  // namespace

struct KeyedMac::Impl {
  EVP_MAC_CTX* ctx = nullptr;
};

KeyedMac::KeyedMac(const Digest256& key) : impl_(new Impl) {
  impl_->ctx = EVP_MAC_CTX_new(hmac_algorithm());
  if (!impl_->ctx) throw std::bad_alloc();
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(impl_->ctx, key.data(), key.size(), params) != 1) {
    EVP_MAC_CTX_free(impl_->ctx);
    throw std::runtime_error("OpenSSL HMAC-SHA256 key setup failed");
  }
}

KeyedMac::~KeyedMac() { EVP_MAC_CTX_free(impl_->ctx); }

void KeyedMac::begin() {
  // A NULL key keeps the key set at construction (OpenSSL 3 HMAC).
  if (EVP_MAC_init(impl_->ctx, nullptr, 0, nullptr) != 1) throw std::runtime_error("OpenSSL HMAC restart failed");
}

void KeyedMac::update(const void* data, size_t n) {
  if (n && EVP_MAC_update(impl_->ctx, static_cast<const unsigned char*>(data), n) != 1)
    throw std::runtime_error("OpenSSL HMAC update failed");
}

Digest256 KeyedMac::finish() {
  Digest256 out;
  size_t len = 0;
  if (EVP_MAC_final(impl_->ctx, out.data(), &len, out.size()) != 1 || len != out.size())
    throw std::runtime_error("OpenSSL HMAC final failed");
  return out;
}

#else  // the bundled HMAC-SHA256: same tags, slower

const char* mac_backend() { return "builtin"; }

struct KeyedMac::Impl {
  explicit Impl(const Digest256& key) : keyed(key.data(), key.size()), current(keyed) {}
  HmacSha256 keyed;    // the key's pads already absorbed
  HmacSha256 current;  // the message in progress
};

KeyedMac::KeyedMac(const Digest256& key) : impl_(new Impl(key)) {}
KeyedMac::~KeyedMac() = default;
void KeyedMac::begin() { impl_->current = impl_->keyed; }
void KeyedMac::update(const void* data, size_t n) { impl_->current.update(data, n); }
Digest256 KeyedMac::finish() { return impl_->current.finish(); }

#endif

Session::Session(const std::string& secret, const uint8_t* nonce_c, const uint8_t* nonce_s, bool is_client)
    : send_(derive_key(secret, is_client ? kKeyLabelClientToServer : kKeyLabelServerToClient, nonce_c, nonce_s)),
      recv_(derive_key(secret, is_client ? kKeyLabelServerToClient : kKeyLabelClientToServer, nonce_c, nonce_s)) {}

KeyedMac& Session::start(KeyedMac& mac, uint64_t& seq, FrameKind kind) {
  uint8_t head[9];
  for (int i = 0; i < 8; ++i) head[i] = uint8_t(seq >> (8 * i));
  head[8] = kind;
  ++seq;
  mac.begin();
  mac.update(head, sizeof(head));
  return mac;
}

void Session::verify(KeyedMac& mac, const uint8_t* tag, const char* what) {
  const Digest256 expected = mac.finish();
  if (!constant_time_equal(tag, expected.data(), kTagBytes))
    throw TransferIntegrityError(std::string("the authentication tag of the ") + what +
                                 " does not match: the connection was tampered with or corrupted on the way "
                                 "(nothing was stored); check what sits between the nodes (proxy, NAT, faulty NIC) "
                                 "and retry");
}

}  // namespace xfer
}  // namespace flashpoint
