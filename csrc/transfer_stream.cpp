// Moving object bytes (see transfer_stream.hpp).
#include "transfer_stream.hpp"

#include "crc32c.hpp"

namespace flashpoint {
namespace xfer {

// past what the populating thread has made ready. Returns the bytes received there: n, or less
// when populating stopped early (the caller then pwrites the rest).
static uint64_t receive_into_mapping(Channel& ch, WarmMapping& map, uint64_t n, size_t chunk, uint32_t* crc) {
  uint64_t done = 0;
  while (done < n) {
    const uint64_t ready = map.wait_populated(std::min<uint64_t>(done + chunk, n));
    if (ready <= done) break;
    const size_t got = ch.recv_some(map.data() + done, static_cast<size_t>(ready - done), "object data");
    *crc = crc32c(map.data() + done, got, *crc);
    done += got;
  }
  return done;
}

// Receives [done, size) through buf: each chunk CRC'd while hot, then pwritten.
static uint32_t receive_by_pwrite(Channel& ch, TempObject& out, uint64_t done, uint64_t size, uint32_t crc,
                           std::vector<uint8_t>& buf) {
  while (done < size) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    const size_t got = ch.recv_some(buf.data(), want, "object data");
    crc = crc32c(buf.data(), got, crc);
    out.write_at(buf.data(), got, done);
    done += got;
  }
  return crc;
}

// Receives size bytes into the temp object, then the trailer; returns the CRC32C of the data.
// The part that lands on a spare's existing pages is received straight into a mapping of them
// (one copy: socket -> page); the rest, and everything when there is no spare, is received into
// buf and pwritten (two copies, but pwrite allocates new pages safely: no SIGBUS on ENOSPC).
// Throws TransferChecksumError when the trailer's length or CRC disagrees.
uint32_t receive_object(Channel& ch, TempObject& out, uint64_t size, std::vector<uint8_t>& buf) {
  uint32_t crc = 0;
  uint64_t done = 0;
  if (WarmMapping* map = out.map_warm_pages()) done = receive_into_mapping(ch, *map, out.mapped_bytes(), buf.size(), &crc);
  crc = receive_by_pwrite(ch, out, done, size, crc, buf);
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

// Sends [offset, offset+size) of file_fd: each chunk is pread into buf and CRC'd (page cache ->
// L2), then sent with sendfile() (no copy into the socket) or send() from buf. Returns the CRC.
uint32_t send_object(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                     std::vector<uint8_t>& buf) {
  uint32_t crc = 0;
  uint64_t done = 0;
  bool use_sendfile = zero_copy;
  while (done < size) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    pread_exactly(file_fd, buf.data(), n, offset + done, offset + size);
    crc = crc32c(buf.data(), n, crc);
    if (use_sendfile) use_sendfile = ch.sendfile_all(file_fd, offset + done, n);
    if (!use_sendfile) ch.send_all(buf.data(), n, "object data");
    done += n;
  }
  return crc;
}

// Sends [offset, offset+size) of file_fd whose CRC32C the caller already knows (from the
// object's index), so the data is never read into user space: one sendfile() for the whole
// range, or pread + send when the kernel cannot sendfile from this file (or zero_copy is off).
// The receiver still checks the bytes against that CRC.
void send_object_known_crc(Channel& ch, int file_fd, uint64_t offset, uint64_t size, bool zero_copy,
                           std::vector<uint8_t>& buf) {
  if (size == 0) return;
  if (zero_copy && ch.sendfile_all(file_fd, offset, size)) return;
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    pread_exactly(file_fd, buf.data(), n, offset + done, offset + size);
    ch.send_all(buf.data(), n, "object data");
    done += n;
  }
}

}  // namespace xfer
}  // namespace flashpoint
