// Framing and handshake of the transfer service (layout: docs/protocol.md).
#include "transfer_wire.hpp"

namespace flashpoint {
namespace xfer {
namespace {

// --- messages -----------------------------------------------------------------------------

// What both handshake MACs and the session secret cover: both ranks and both nonces.
struct Transcript {
  uint8_t bytes[4 + 4 + kNonceBytes + kNonceBytes];
  Transcript(uint32_t client_rank, uint32_t server_rank, const uint8_t* nonce_c, const uint8_t* nonce_s) {
    put_u32(bytes, client_rank);
    put_u32(bytes + 4, server_rank);
    std::memcpy(bytes + 8, nonce_c, kNonceBytes);
    std::memcpy(bytes + 8 + kNonceBytes, nonce_s, kNonceBytes);
  }
};

Digest256 handshake_mac(const Digest256& key, const char* label, const Transcript& t) {
  HmacSha256 h(key.data(), key.size());
  h.update(label, std::strlen(label));
  h.update(t.bytes, sizeof(t.bytes));
  return h.finish();
}

// The session's secret, keyed by both ranks' keys: only the two ranks (and holders of the job
// secret) can derive the direction keys from it.
std::unique_ptr<Session> start_session(const Digest256& client_key, const Digest256& server_key, const Transcript& t,
                                       const uint8_t* nonce_c, const uint8_t* nonce_s, bool is_client) {
  uint8_t both[2 * 32];
  std::memcpy(both, client_key.data(), 32);
  std::memcpy(both + 32, server_key.data(), 32);
  HmacSha256 h(both, sizeof(both));
  secure_zero(both, sizeof(both));
  h.update(kSessionLabel, std::strlen(kSessionLabel));
  h.update(t.bytes, sizeof(t.bytes));
  Digest256 session_secret = h.finish();
  std::string secret(reinterpret_cast<const char*>(session_secret.data()), session_secret.size());
  secure_zero(session_secret.data(), session_secret.size());
  std::unique_ptr<Session> session(new Session(secret, nonce_c, nonce_s, is_client));
  secure_zero(&secret[0], secret.size());
  return session;
}

void check_magic(const uint8_t* msg, const char* who) {
  if (std::memcmp(msg, kMagic, sizeof(kMagic)) != 0)
    throw TransferError(std::string("bad protocol magic from the ") + who + " (not a flashpoint transfer peer)");
}

void check_version(const uint8_t* msg, const char* who) {
  const uint32_t version = get_u32(msg + 8);
  if (version != kProtocolVersion)
    throw TransferError(std::string("unsupported protocol version ") + std::to_string(version) + " from the " + who +
                        " (this side speaks " + std::to_string(kProtocolVersion) +
                        "): install the same ml_flashpoint_nemo version on every node of the job");
}

}  // namespace

const char* status_name(uint32_t s) {
  switch (s) {
    case kOk: return "ok";
    case kBadRequest: return "bad request";
    case kPathRefused: return "path refused";
    case kTooLarge: return "too large";
    case kNotFound: return "not found";
    case kChecksum: return "checksum mismatch";
    case kIoError: return "I/O error";
    case kIntegrity: return "integrity check failed";
    case kForbidden: return "not permitted";
    case kNoSpace: return "no space";
    default: return "unknown status";
  }
}


std::string quoted(const std::string& s) {
  std::string out = "'";
  for (unsigned char c : s.substr(0, 200)) {
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += char(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out + "'";
}


std::string random_hex(size_t bytes) {
  std::vector<uint8_t> raw(bytes);
  random_bytes(raw.data(), raw.size());
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : raw) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

Digest256 rank_key(const std::string& secret, uint32_t rank) {
  uint8_t r[4];
  put_u32(r, rank);
  HmacSha256 h(secret.data(), secret.size());
  h.update(kRankKeyLabel, std::strlen(kRankKeyLabel));
  h.update(r, sizeof(r));
  return h.finish();
}

void ServerHandshake::answer(const std::string& secret, uint32_t server_rank, const uint8_t* hello, uint8_t* reply) {
  check_magic(hello, "client");
  std::memcpy(reply, kMagic, sizeof(kMagic));
  put_u32(reply + 8, kProtocolVersion);
  put_u32(reply + 12, server_rank);
  if (get_u32(hello + 8) != kProtocolVersion) {
    // An older (or newer) client learns our version from a hello whose rank and MAC are zero; the
    // caller sends it, then closes.
    put_u32(reply + 12, 0);
    std::memset(reply + 16, 0, kNonceBytes + kMacBytes);
    try {
      check_version(hello, "client");
    } catch (const TransferError& e) {
      throw VersionMismatchError(e.what());
    }
  }
  server_rank_ = server_rank;
  client_rank_ = get_u32(hello + 12);
  std::memcpy(nonce_c_, hello + 16, kNonceBytes);
  random_bytes(nonce_s_, kNonceBytes);
  std::memcpy(reply + 16, nonce_s_, kNonceBytes);
  const Transcript t(client_rank_, server_rank_, nonce_c_, nonce_s_);
  const Digest256 server_key = rank_key(secret, server_rank_);
  const Digest256 server_mac = handshake_mac(server_key, kServerLabel, t);
  std::memcpy(reply + 16 + kNonceBytes, server_mac.data(), kMacBytes);
}

std::unique_ptr<Session> ServerHandshake::finish(const std::string& secret, uint32_t rank_limit,
                                                 const uint8_t* proof) const {
  const Transcript t(client_rank_, server_rank_, nonce_c_, nonce_s_);
  const Digest256 client_key = rank_key(secret, client_rank_);
  const Digest256 expected = handshake_mac(client_key, kClientLabel, t);
  if (!constant_time_equal(proof, expected.data(), kMacBytes))
    throw TransferAuthError("client failed authentication as rank " + std::to_string(client_rank_) +
                            " (wrong job secret, or it is not that rank)");
  if (rank_limit != 0 && client_rank_ >= rank_limit)
    throw TransferAuthError("client authenticated as rank " + std::to_string(client_rank_) + ", but the job has " +
                            std::to_string(rank_limit) + " ranks");
  const Digest256 server_key = rank_key(secret, server_rank_);
  return start_session(client_key, server_key, t, nonce_c_, nonce_s_, /*is_client=*/false);
}

void client_handshake(Channel& ch, const std::string& secret, uint32_t client_rank, uint32_t server_rank) {
  uint8_t hello[kClientHelloBytes];
  std::memcpy(hello, kMagic, sizeof(kMagic));
  put_u32(hello + 8, kProtocolVersion);
  put_u32(hello + 12, client_rank);
  uint8_t* nonce_c = hello + 16;
  random_bytes(nonce_c, kNonceBytes);
  ch.send_all(hello, sizeof(hello), "client hello");
  uint8_t reply[kServerHelloBytes];
  ch.recv_exact(reply, sizeof(reply), "server hello");
  check_magic(reply, "server");
  check_version(reply, "server");
  const uint32_t claimed = get_u32(reply + 12);
  if (claimed != server_rank)
    throw TransferAuthError("the server is rank " + std::to_string(claimed) + ", not rank " +
                            std::to_string(server_rank) + " (the address list of the job is out of date, or "
                            "another rank's server took this port)");
  const uint8_t* nonce_s = reply + 16;
  const Transcript t(client_rank, server_rank, nonce_c, nonce_s);
  const Digest256 server_key = rank_key(secret, server_rank);
  const Digest256 expected = handshake_mac(server_key, kServerLabel, t);
  if (!constant_time_equal(reply + 16 + kNonceBytes, expected.data(), kMacBytes))
    throw TransferAuthError("server failed authentication as rank " + std::to_string(server_rank) +
                            " (wrong job secret on one side, or not the expected peer)");
  const Digest256 client_key = rank_key(secret, client_rank);
  const Digest256 proof = handshake_mac(client_key, kClientLabel, t);
  ch.send_all(proof.data(), proof.size(), "client proof");
  ch.start_session(start_session(client_key, server_key, t, nonce_c, nonce_s, /*is_client=*/true));
}

void send_tag(Channel& ch, KeyedMac& mac, const char* what, int flags) {
  const GmacTag tag = mac.finish();
  ch.send_all(tag.data(), kTagBytes, what, flags);
}

void recv_tag(Channel& ch, KeyedMac& mac, const char* what) {
  uint8_t tag[kTagBytes];
  ch.recv_exact(tag, sizeof(tag), what);
  ch.session().verify(mac, tag, what);
}

namespace {
// Sends body followed by its tag, in one send.
void send_authenticated(Channel& ch, FrameKind kind, std::vector<uint8_t>& body, const char* what) {
  KeyedMac& mac = ch.session().start_send(kind);
  mac.update(body.data(), body.size());
  const GmacTag tag = mac.finish();
  body.insert(body.end(), tag.begin(), tag.end());
  ch.send_all(body.data(), body.size(), what);
}
}  // namespace

void send_request(Channel& ch, uint32_t op, const std::string& path, uint64_t size) {
  std::vector<uint8_t> buf(kRequestBytes + path.size());
  put_u32(buf.data(), op);
  put_u32(buf.data() + 4, static_cast<uint32_t>(path.size()));
  put_u64(buf.data() + 8, size);
  put_u32(buf.data() + 16, 0);
  put_u32(buf.data() + 20, 0);
  std::memcpy(buf.data() + kRequestBytes, path.data(), path.size());
  send_authenticated(ch, kFrameRequest, buf, "request");
}

void send_response(Channel& ch, uint32_t status, uint64_t value, const std::string& message) {
  const std::string msg = message.substr(0, kMaxMessageBytes);
  std::vector<uint8_t> buf(kResponseBytes + msg.size());
  put_u32(buf.data(), status);
  put_u32(buf.data() + 4, static_cast<uint32_t>(msg.size()));
  put_u64(buf.data() + 8, value);
  std::memcpy(buf.data() + kResponseBytes, msg.data(), msg.size());
  send_authenticated(ch, kFrameResponse, buf, "response");
}

Response recv_response(Channel& ch) {
  uint8_t head[kResponseBytes];
  ch.recv_exact(head, sizeof(head), "response");
  Response r;
  r.status = get_u32(head);
  const uint32_t len = get_u32(head + 4);
  r.value = get_u64(head + 8);
  // Only the length is read before the tag, to find the tag; a length no peer sends cannot be authenticated.
  if (len > kMaxMessageBytes)
    throw TransferIntegrityError("response with a message length of " + std::to_string(len) + " (over " +
                                 std::to_string(kMaxMessageBytes) +
                                 "): it cannot be authenticated; the connection was tampered with or corrupted");
  r.message.resize(len);
  if (len) ch.recv_exact(&r.message[0], len, "response message");
  KeyedMac& mac = ch.session().start_recv(kFrameResponse);
  mac.update(head, sizeof(head));
  mac.update(r.message.data(), r.message.size());
  recv_tag(ch, mac, "response");
  if (r.status > kLastStatus) throw TransferError("malformed response: unknown status " + std::to_string(r.status));
  return r;
}

void send_trailer(Channel& ch, uint64_t nbytes, uint32_t crc) {
  uint8_t t[kTrailerBytes];
  put_u64(t, nbytes);
  put_u32(t + 8, crc);
  put_u32(t + 12, kTrailerMagic);
  std::vector<uint8_t> body(t, t + sizeof(t));
  send_authenticated(ch, kFrameTrailer, body, "trailer");
}

// Checks the trailer that follows the data against the length and CRC32C received.
void check_trailer(Channel& ch, uint64_t size, uint32_t crc) {
  uint8_t t[kTrailerBytes];
  ch.recv_exact(t, sizeof(t), "trailer");
  KeyedMac& mac = ch.session().start_recv(kFrameTrailer);
  mac.update(t, sizeof(t));
  recv_tag(ch, mac, "trailer");
  if (get_u32(t + 12) != kTrailerMagic) throw TransferError("malformed trailer (bad end magic)");
  const uint64_t their_n = get_u64(t);
  const uint32_t their_crc = get_u32(t + 8);
  if (their_n != size)
    throw TransferChecksumError("length mismatch: the sender announced " + std::to_string(size) +
                                " bytes but its trailer says " + std::to_string(their_n));
  if (their_crc != crc) {
    char msg[160];
    std::snprintf(msg, sizeof(msg), "CRC32C mismatch: the sender's is %08x, the received bytes give %08x", their_crc,
                  crc);
    throw TransferChecksumError(msg);
  }
}

}  // namespace xfer
}  // namespace flashpoint
