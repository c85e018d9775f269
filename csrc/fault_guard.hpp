// Copies from (or into) a mapping of a file that another process may truncate.
//
// A load copies from a shared mapping of the object file. If someone truncates the file meanwhile,
// the pages past its new end are gone and touching them raises SIGBUS, which would kill the
// trainer. While a thread runs a guarded call, a SIGBUS at an address inside the call's range makes
// that call return false instead; the caller turns it into an error. Any other fault (another
// thread, another address) goes to the handler that was installed before ours, or to the default
// action, as if we had never installed one; a SIGBUS sent with kill() ends the process.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashpoint {

// Installs the SIGBUS handler if it is not the current one (someone may have replaced it since,
// e.g. Python's faulthandler: that handler is then kept as the one to pass other faults to).
// Call it once before a batch of guarded calls, from any thread.
void install_fault_guard();

// Runs fn(arg) and returns true, or returns false as soon as a SIGBUS hits [begin, begin+n).
// fn must be a leaf that a jump may abandon at any instruction: no locks, no allocation, nothing
// to clean up (a copy or a checksum of plain memory). install_fault_guard() must have run.
bool run_guarded(const void* begin, size_t n, void (*fn)(void*), void* arg);

}  // namespace flashpoint
