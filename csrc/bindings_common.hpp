// Helpers shared by the binding files (bindings.cpp, transfer_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace flashpoint {
namespace bindings {

namespace py = pybind11;

// A buffer request that refuses non-contiguous views.
py::buffer_info request_readable(const py::buffer& data);
// The one door from C++ text to Python str for anything a peer may have chosen.
std::string printable_text(const std::string& text);
// Registers TransferServer, push/fetch and the transfer exceptions on the module.
void register_transfer(py::module_& m);

}  // namespace bindings
}  // namespace flashpoint
