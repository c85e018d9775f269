// Message authentication of a transfer session (protocol v3, docs/protocol.md): one AES-256-GMAC
// key per direction (libcrypto, crypto.hpp), derived from the handshake with HMAC-SHA256, and a 96-bit nonce per message
// made of the direction, the message's kind and a sequence number per direction, so that a relay
// cannot reorder, replay, drop or splice authenticated messages, nor pass one kind off as another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "crypto.hpp"

namespace flashpoint {
namespace xfer {

constexpr size_t kTagBytes = kGmacTagBytes;  // a 16-byte AES-256-GMAC tag after every authenticated message

// Kinds of authenticated message; the kind is part of every tag's nonce (a request is never a response).
enum FrameKind : uint8_t { kFrameRequest = 1, kFrameResponse = 2, kFrameData = 3, kFrameTrailer = 4 };
// The first byte of the nonce: which way the message travels.
enum Direction : uint8_t { kClientToServer = 1, kServerToClient = 2 };

// Tags one message at a time: begin (by the Session), update with its bytes, finish.
using KeyedMac = Gmac;

// Both directions of one authenticated connection: one libcrypto context per direction, made
// once with the session and reused for every message. Used by the connection's thread only.
class Session {
 public:
  // is_client chooses which derived key sends and which receives.
  Session(const std::string& secret, const uint8_t* nonce_c, const uint8_t* nonce_s, bool is_client);

  // Starts the tag of the next message this side sends (or receives): its nonce carries the
  // direction, the kind and the direction's next sequence number.
  KeyedMac& start_send(FrameKind kind) { return start(send_, send_direction_, send_seq_, kind); }
  KeyedMac& start_recv(FrameKind kind) { return start(recv_, recv_direction_, recv_seq_, kind); }
  // Finishes a received message's tag; TransferIntegrityError naming what when it differs.
  void verify(KeyedMac& mac, const uint8_t* tag, const char* what);

 private:
  static KeyedMac& start(KeyedMac& mac, Direction direction, uint64_t& seq, FrameKind kind);
  KeyedMac send_, recv_;
  Direction send_direction_, recv_direction_;
  uint64_t send_seq_ = 0, recv_seq_ = 0;
};

}  // namespace xfer
}  // namespace flashpoint
