// Session keys and tags of the transfer protocol (see transfer_mac.hpp).
#include "transfer_mac.hpp"

#include <cstring>

#include "transfer.hpp"

namespace flashpoint {
namespace xfer {
namespace {

constexpr const char kKeyLabelClientToServer[] = "mlfp-xfer-v3 key client->server";
constexpr const char kKeyLabelServerToClient[] = "mlfp-xfer-v3 key server->client";

// An AES-256 key: HMAC-SHA256(secret, label || nonce_c || nonce_s).
class DerivedKey {
 public:
  DerivedKey(const std::string& secret, const char* label, const uint8_t* nonce_c, const uint8_t* nonce_s) {
    HmacSha256 h(secret.data(), secret.size());
    h.update(label, std::strlen(label));
    h.update(nonce_c, 32);
    h.update(nonce_s, 32);
    key_ = h.finish();
  }
  ~DerivedKey() { secure_zero(key_.data(), key_.size()); }
  const uint8_t* data() const { return key_.data(); }

 private:
  Digest256 key_;
};

}  // namespace

Session::Session(const std::string& secret, const uint8_t* nonce_c, const uint8_t* nonce_s, bool is_client)
    : send_(DerivedKey(secret, is_client ? kKeyLabelClientToServer : kKeyLabelServerToClient, nonce_c, nonce_s).data()),
      recv_(DerivedKey(secret, is_client ? kKeyLabelServerToClient : kKeyLabelClientToServer, nonce_c, nonce_s).data()),
      send_direction_(is_client ? kClientToServer : kServerToClient),
      recv_direction_(is_client ? kServerToClient : kClientToServer) {}

// Nonce: u8 direction · u8 kind · u16 zero · u64 seq (little-endian).
KeyedMac& Session::start(KeyedMac& mac, Direction direction, uint64_t& seq, FrameKind kind) {
  uint8_t nonce[kGmacNonceBytes] = {0};
  nonce[0] = direction;
  nonce[1] = kind;
  for (int i = 0; i < 8; ++i) nonce[4 + i] = uint8_t(seq >> (8 * i));
  ++seq;
  mac.begin(nonce);
  return mac;
}

void Session::verify(KeyedMac& mac, const uint8_t* tag, const char* what) {
  const GmacTag expected = mac.finish();
  if (!constant_time_equal(tag, expected.data(), kTagBytes))
    throw TransferIntegrityError(std::string("the authentication tag of the ") + what +
                                 " does not match: the connection was tampered with or corrupted on the way "
                                 "(nothing was stored); check what sits between the nodes (proxy, NAT, faulty NIC) "
                                 "and retry");
}

}  // namespace xfer
}  // namespace flashpoint
