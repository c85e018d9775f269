// Helpers shared by the binding files (see bindings_common.hpp).
#include "bindings_common.hpp"

namespace flashpoint {
namespace bindings {

py::buffer_info request_readable(const py::buffer& data) {
  py::buffer_info info = data.request();
  // 1-d views can be strided too (memoryview(b)[::2], [::-1]): check every dimension.
  if (!PyBuffer_IsContiguous(info.view(), 'C')) throw std::invalid_argument("buffer must be C-contiguous");
  return info;
}

// The one door from C++ text to Python str for anything a peer may have chosen (names in
// messages, a peer's refusal text, server errors): printable ASCII stays, every other byte
// becomes \xNN. So such text never raises UnicodeDecodeError and never starts a log line.
std::string printable_text(const std::string& text) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

}  // namespace bindings
}  // namespace flashpoint
