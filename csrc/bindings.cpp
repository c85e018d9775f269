// Python bindings: ml_flashpoint_nemo._core.
//
// Every function that copies, checksums or waits on the kernel releases the GIL.
// Operation lists come in as flat uint64 buffers (array.array('Q')) of triples
// or pairs, which are cheap to build in Python for thousands of tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <mutex>

#include "copy_engine.hpp"
#include "crc32c.hpp"
#include "errors.hpp"
#include "file_reads.hpp"
#include "shm_buffer.hpp"
#include "bindings_common.hpp"

namespace py = pybind11;
using namespace flashpoint;
using flashpoint::bindings::printable_text;
using flashpoint::bindings::register_transfer;
using flashpoint::bindings::request_readable;

namespace {

template <typename Op, size_t Fields>
std::vector<Op> ops_from_buffer(const py::buffer& flat) {
  static_assert(sizeof(Op) == Fields * sizeof(uint64_t), "op layout must be packed uint64 fields");
  py::buffer_info info = flat.request();
  const char kind = info.format.empty() ? '?' : info.format.back();
  if (info.itemsize != sizeof(uint64_t) || (kind != 'Q' && kind != 'L') || info.ndim != 1 || (info.strides[0] != sizeof(uint64_t) && info.size > 1))
    throw std::invalid_argument("operations must be a contiguous 1-d buffer of uint64 (array.array('Q'))");
  if (info.size % Fields != 0)
    throw std::invalid_argument("operation buffer length must be a multiple of " + std::to_string(Fields));
  std::vector<Op> ops(static_cast<size_t>(info.size) / Fields);
  if (!ops.empty()) std::memcpy(ops.data(), info.ptr, ops.size() * sizeof(Op));
  return ops;
}


// Buffer protocol with an export count, so close() can refuse while views live.
int shm_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  ShmBuffer* self = nullptr;
  try {
    self = py::handle(obj).cast<ShmBuffer*>();
  } catch (...) {
    PyErr_SetString(PyExc_TypeError, "not a ShmBuffer");
    return -1;
  }
  std::shared_lock<std::shared_mutex> guard(self->mapping_lock());
  if (self->closed()) {
    PyErr_SetString(PyExc_ValueError, "buffer is closed");
    return -1;
  }
  if ((flags & PyBUF_WRITABLE) && !self->writable()) {
    PyErr_SetString(PyExc_BufferError, "buffer is read-only");
    return -1;
  }
  if (PyBuffer_FillInfo(view, obj, self->data(), static_cast<Py_ssize_t>(self->size()), self->writable() ? 0 : 1,
                        flags) != 0)
    return -1;
  self->exports().fetch_add(1);
  return 0;
}

void shm_releasebuffer(PyObject* obj, Py_buffer*) {
  try {
    py::handle(obj).cast<ShmBuffer*>()->exports().fetch_sub(1);
  } catch (...) {
  }
}



}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ core of ml_flashpoint_nemo: tmpfs buffers, parallel copy with CRC32C, file reads.";

  py::register_exception<ShortReadError>(m, "ShortReadError", PyExc_EOFError);
  py::register_exception<BufferBusyError>(m, "BufferBusyError", PyExc_BufferError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OsError& e) {
      // The message may name a path a peer chose; the filename is the file system's bytes, as os.fsdecode.
      py::object filename = py::none();
      if (!e.path().empty()) {
        PyObject* decoded = PyUnicode_DecodeFSDefaultAndSize(e.path().data(), static_cast<Py_ssize_t>(e.path().size()));
        if (decoded != nullptr) filename = py::reinterpret_steal<py::object>(decoded);
        else PyErr_Clear();
      }
      py::object err = py::module_::import("builtins").attr("OSError")(e.error_number(), printable_text(e.what()),
                                                                       filename);
      PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });

  m.def(
      "crc32c",
      [](const py::buffer& data, uint32_t crc) {
        py::buffer_info info = request_readable(data);
        const size_t n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release release;
        return crc32c(info.ptr, n, crc);
      },
      py::arg("data"), py::arg("crc") = 0, "CRC32C of a bytes-like object, continuing from crc.");
  m.def(
      "crc32c_software",
      [](const py::buffer& data, uint32_t crc) {
        py::buffer_info info = request_readable(data);
        return crc32c_software(info.ptr, static_cast<size_t>(info.size * info.itemsize), crc);
      },
      py::arg("data"), py::arg("crc") = 0, "Portable table-driven CRC32C (the reference for tests).");
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
        "CRC32C of A||B from the CRCs of A and B and the length of B.");
  m.def("crc32c_backend", &crc32c_backend, "Which CRC32C implementation this CPU uses.");
  m.def("crc32c_backends", &crc32c_backends, "The CRC32C implementations this CPU can run, fastest first.");
  m.def(
      "crc32c_using",
      [](const std::string& backend, const py::buffer& data, uint32_t crc) {
        py::buffer_info info = request_readable(data);
        const size_t n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release release;
        return crc32c_using(backend, info.ptr, n, crc);
      },
      py::arg("backend"), py::arg("data"), py::arg("crc") = 0,
      "CRC32C with the named implementation (one of crc32c_backends()), for tests and benchmarks.");
  m.def("page_size", &page_size);

  py::class_<ShmBuffer> buffer_class(m, "ShmBuffer", py::buffer_protocol(),
                                     "A tmpfs file mapped MAP_SHARED, with space reserved up front.");
  buffer_class
      .def_static(
          "create",
          [](const std::string& path, size_t size) {
            py::gil_scoped_release release;
            return ShmBuffer::create(path, size);
          },
          py::arg("path"), py::arg("size"),
          "Create a new file of at least size bytes (rounded up to pages); ENOSPC raises OSError.")
      .def_static(
          "open",
          [](const std::string& path, bool writable) {
            py::gil_scoped_release release;
            return ShmBuffer::open(path, writable);
          },
          py::arg("path"), py::arg("writable") = false, "Map an existing buffer file.")
      .def(
          "grow",
          [](ShmBuffer& self, size_t size) {
            py::gil_scoped_release release;
            self.grow(size);
          },
          py::arg("size"))
      .def(
          "prefault",
          [](ShmBuffer& self, size_t offset, py::object length) {
            const size_t n = length.is_none() ? SIZE_MAX : length.cast<size_t>();
            py::gil_scoped_release release;
            self.prefault(offset, n);
          },
          py::arg("offset") = 0, py::arg("length") = py::none(),
          "Fault pages in now (MADV_POPULATE_WRITE, or touching pages on old kernels).")
      .def(
          "rename_to",
          [](ShmBuffer& self, const std::string& path) {
            py::gil_scoped_release release;
            self.rename_to(path);
          },
          py::arg("path"))
      .def(
          "close",
          [](ShmBuffer& self) {
            py::gil_scoped_release release;
            self.close();
          })
      .def_property_readonly("size", &ShmBuffer::size)
      .def_property_readonly("path", &ShmBuffer::path)
      .def_property_readonly("writable", &ShmBuffer::writable)
      .def_property_readonly("closed", &ShmBuffer::closed)
      .def_property_readonly("fd",
                             [](ShmBuffer& self) {
                               std::shared_lock<std::shared_mutex> guard(self.mapping_lock());
                               return self.closed() ? -1 : self.fd();
                             },
                             "The descriptor of the mapped file (e.g. for os.fstat), -1 once closed.")
      .def_property_readonly("address", [](const ShmBuffer& self) { return reinterpret_cast<uintptr_t>(self.data()); })
      .def("__repr__", [](const ShmBuffer& self) {
        return "<ShmBuffer " + self.path() + " size=" + std::to_string(self.size()) +
               (self.closed() ? " closed>" : ">");
      });
  auto* heap_type = reinterpret_cast<PyHeapTypeObject*>(buffer_class.ptr());
  heap_type->as_buffer.bf_getbuffer = shm_getbuffer;
  heap_type->as_buffer.bf_releasebuffer = shm_releasebuffer;

  m.def(
      "copy_into_buffer",
      [](ShmBuffer& buffer, const py::buffer& ops, bool checksum, int threads) {
        auto parsed = ops_from_buffer<MemToBufferOp, 3>(ops);
        py::gil_scoped_release release;
        return copy_into_buffer(buffer, parsed, checksum, threads);
      },
      py::arg("buffer"), py::arg("ops"), py::arg("checksum") = true, py::arg("threads") = 1,
      "Copy (src_address, dst_offset, nbytes) triples into buffer; returns one CRC32C per op.");
  m.def(
      "read_file_into",
      [](int fd, const py::buffer& ops, bool checksum, int threads, const std::string& method) {
        auto parsed = ops_from_buffer<FileToMemOp, 4>(ops);
        const ReadMethod how = read_method_from_name(method);
        py::gil_scoped_release release;
        return read_file_into(fd, parsed, checksum, threads, how);
      },
      py::arg("fd"), py::arg("ops"), py::arg("checksum") = true, py::arg("threads") = 1, py::arg("method") = "auto",
      "Copy (file_offset, dst_address, nbytes, dst_capacity) rows of a file straight into memory; returns one\n"
      "CRC32C per op. A row whose nbytes exceeds dst_capacity (the destination's own size) raises IndexError\n"
      "before any byte is read; a file shorter than a row, or one truncated during the read, raises\n"
      "ShortReadError. method: 'auto' (maps files whose pages are huge, preads others), 'map' or 'pread'.");
  m.def(
      "read_buffer_into",
      [](ShmBuffer& buffer, const py::buffer& ops, bool checksum, int threads) {
        auto parsed = ops_from_buffer<FileToMemOp, 4>(ops);
        py::gil_scoped_release release;
        return read_buffer_into(buffer, parsed, checksum, threads);
      },
      py::arg("buffer"), py::arg("ops"), py::arg("checksum") = true, py::arg("threads") = 1,
      "read_file_into from the file's mapping in buffer: rows (offset, dst_address, nbytes, dst_capacity), one\n"
      "CRC32C per op. Every row is checked against its destination and the buffer (IndexError) before any byte\n"
      "moves; a closed buffer raises RuntimeError, a file truncated below a row ShortReadError.");
  m.def(
      "checksum_file_ranges",
      [](int fd, const py::buffer& ops, int threads, const std::string& method) {
        auto parsed = ops_from_buffer<RangeOp, 2>(ops);
        const ReadMethod how = read_method_from_name(method);
        py::gil_scoped_release release;
        return checksum_file_ranges(fd, parsed, threads, how);
      },
      py::arg("fd"), py::arg("ops"), py::arg("threads") = 1, py::arg("method") = "auto",
      "CRC32C of (offset, nbytes) ranges of a file; method as for read_file_into.");
  m.def(
      "read_method_for",
      [](int fd, uint64_t offset, uint64_t nbytes) {
        py::gil_scoped_release release;
        return std::string(read_method_name(choose_read_method(fd, offset, nbytes)));
      },
      py::arg("fd"), py::arg("offset"), py::arg("nbytes"),
      "'map' or 'pread': what method='auto' picks for reading [offset, +nbytes) of fd.");
  m.def(
      "checksum_buffer_ranges",
      [](ShmBuffer& buffer, const py::buffer& ops, int threads) {
        auto parsed = ops_from_buffer<RangeOp, 2>(ops);
        py::gil_scoped_release release;
        return checksum_buffer_ranges(buffer, parsed, threads);
      },
      py::arg("buffer"), py::arg("ops"), py::arg("threads") = 1, "CRC32C of (offset, nbytes) ranges of a buffer.");

  register_transfer(m);
}
