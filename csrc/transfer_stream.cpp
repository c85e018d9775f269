// Moving object bytes (see transfer_stream.hpp).
#include "transfer_stream.hpp"

#include "crc32c.hpp"

namespace flashpoint {
namespace xfer {

// Receives size bytes (chunk by chunk, each followed by its tag) into the temp object, then the
// trailer; returns the CRC32C of the data. CRC and tag are computed on each piece while it is hot.
// The part that lands on a spare's existing pages is received straight into a mapping of them
// (one copy: socket -> page); the rest, and everything when there is no spare, is received into
// buf and pwritten (two copies, but pwrite allocates new pages safely: no SIGBUS on ENOSPC).
// The read that completes a chunk also takes its tag (one recvmsg, no extra call per chunk).
// Throws TransferIntegrityError when a chunk's or the trailer's tag is wrong (the bytes already
// written are only in the temp file), TransferChecksumError when the trailer's length or CRC disagrees.
uint32_t receive_object(Channel& ch, TempObject& out, uint64_t size, std::vector<uint8_t>& buf) {
  uint32_t crc = 0;
  WarmMapping* map = out.map_warm_pages();
  uint64_t mapped = map ? out.mapped_bytes() : 0;  // lowered when populating stops early
  struct DefaultLowWater {  // also when a chunk fails: whoever reads next expects the default
    Channel& ch;
    ~DefaultLowWater() { ch.set_receive_low_water(1); }
  } default_low_water{ch};
  for (uint64_t start = 0; start < size;) {
    const uint64_t end = std::min<uint64_t>(size, start + kChunkBytes);
    KeyedMac& mac = ch.session().start_recv(kFrameData);
    uint8_t tag[kTagBytes];
    size_t tag_got = 0;
    // Receives [pos, pos + want) into dst (the chunk's last bytes together with its tag).
    const auto receive = [&](uint8_t* dst, uint64_t pos, size_t want) {
      const size_t got = pos + want == end ? ch.recv_some_then(dst, want, tag, sizeof(tag), &tag_got, "object data")
                                           : ch.recv_some(dst, want, "object data");
      crc = crc32c(dst, got, crc);
      mac.update(dst, got);
      return got;
    };
    for (uint64_t pos = start; pos < end;) {
      // The rest of this chunk and its tag are what the peer must still send, whatever it does next.
      ch.set_receive_low_water(static_cast<int>(std::min<uint64_t>(kReceiveLowWater, end - pos + sizeof(tag))));
      if (pos < mapped) {
        const uint64_t ready = map->wait_populated(std::min(end, mapped));
        if (ready > pos) {
          pos += receive(map->data() + pos, pos, static_cast<size_t>(ready - pos));
          continue;
        }
        mapped = pos;
      }
      const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - pos));
      const size_t got = receive(buf.data(), pos, want);
      out.write_at(buf.data(), got, pos);
      pos += got;
    }
    if (tag_got < sizeof(tag)) {  // a few bytes, perhaps in more than one segment: any byte wakes the receiver
      ch.set_receive_low_water(1);
      ch.recv_exact(tag + tag_got, sizeof(tag) - tag_got, "object data chunk");
    }
    ch.session().verify(mac, tag, "object data chunk");
    start = end;
  }
  ch.set_receive_low_water(1);  // the trailer and every later message are small
  check_trailer(ch, size, crc);
  return crc;
}

// Reads n bytes at offset; end is where the range being sent ends (for the message).
static void pread_exactly(int file_fd, uint8_t* dst, size_t n, uint64_t offset, uint64_t end) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(file_fd, dst + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw OsError(errno, "reading the object to send failed", "");
    }
    if (r == 0)
      throw ShortReadError("source file ended at " + std::to_string(offset + got) + " bytes, before the " +
                           std::to_string(end) + " being sent (was it truncated?)");
    got += static_cast<size_t>(r);
  }
}

// Sends [offset, offset+size) chunk by chunk: each is pread into buf (page cache -> L2), tagged
// (and CRC'd when crc is given) there, then sent with send() from buf (or, with zero_copy, with
// sendfile(), which measured more CPU on both ends: the bytes were read for the tag anyway, and
// sendfile's page-sized pieces make more, smaller segments), followed by its tag. The tag goes out with MSG_MORE, so it travels in the
// next chunk's first segment instead of a segment of its own (the trailer, sent without it,
// pushes the last one). SIGPIPE is blocked once for the whole object, not per sendfile call.
static void send_chunks(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                        std::vector<uint8_t>& buf, uint32_t* crc) {
  bool use_sendfile = zero_copy;
  const SigpipeGuard sigpipe_blocked;
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - done));
    if (buf.size() < n) buf.resize(n);
    pread_exactly(file_fd, buf.data(), n, offset + done, offset + size);
    if (crc) *crc = crc32c(buf.data(), n, *crc);
    KeyedMac& mac = ch.session().start_send(kFrameData);
    mac.update(buf.data(), n);
    if (use_sendfile) use_sendfile = ch.sendfile_all(file_fd, offset + done, n, sigpipe_blocked);
    if (!use_sendfile) ch.send_all(buf.data(), n, "object data");
    send_tag(ch, mac, "object data tag", MSG_MORE);
    done += n;
  }
}

uint32_t send_object(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                     std::vector<uint8_t>& buf) {
  uint32_t crc = 0;
  send_chunks(ch, file_fd, offset, size, zero_copy, buf, &crc);
  return crc;
}

// The CRC32C is known (from the object's index), but the tags still need every byte in user
// space, so this is send_object without the CRC.
void send_object_known_crc(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                           std::vector<uint8_t>& buf) {
  send_chunks(ch, file_fd, offset, size, zero_copy, buf, nullptr);
}

}  // namespace xfer
}  // namespace flashpoint
