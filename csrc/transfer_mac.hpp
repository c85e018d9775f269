// Message authentication of a transfer session (protocol v2, docs/protocol.md): one HMAC-SHA256
// key per direction, derived from the handshake, and a sequence number per direction so that a
// relay cannot reorder, replay, drop or splice authenticated messages. The HMAC runs on OpenSSL's
// libcrypto when the build found it (SHA-NI), else on the bundled csrc/sha256.cpp (same bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "sha256.hpp"

namespace flashpoint {
namespace xfer {

constexpr size_t kTagBytes = 32;  // a full HMAC-SHA256 after every authenticated message

// Kinds of authenticated message; the kind is part of every tag (a request is never a response).
enum FrameKind : uint8_t { kFrameRequest = 1, kFrameResponse = 2, kFrameData = 3, kFrameTrailer = 4 };

// "openssl" or "builtin": which HMAC-SHA256 implementation this build uses.
const char* mac_backend();

// HMAC-SHA256 under one fixed key, restarted for every message without redoing the key setup.
class KeyedMac {
 public:
  explicit KeyedMac(const Digest256& key);
  ~KeyedMac();
  KeyedMac(const KeyedMac&) = delete;
  KeyedMac& operator=(const KeyedMac&) = delete;
  void begin();
  void update(const void* data, size_t n);
  Digest256 finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Both directions of one authenticated connection.
class Session {
 public:
  // is_client chooses which derived key sends and which receives.
  Session(const std::string& secret, const uint8_t* nonce_c, const uint8_t* nonce_s, bool is_client);

  // Starts the tag of the next message this side sends (or receives): covers seq and kind.
  KeyedMac& start_send(FrameKind kind) { return start(send_, send_seq_, kind); }
  KeyedMac& start_recv(FrameKind kind) { return start(recv_, recv_seq_, kind); }
  // Finishes a received message's tag; TransferIntegrityError naming what when it differs.
  void verify(KeyedMac& mac, const uint8_t* tag, const char* what);

 private:
  static KeyedMac& start(KeyedMac& mac, uint64_t& seq, FrameKind kind);
  KeyedMac send_, recv_;
  uint64_t send_seq_ = 0, recv_seq_ = 0;
};

}  // namespace xfer
}  // namespace flashpoint
