// Which version a push may go into, and how large an object may be when no commit record of this
// node gives its size (docs/security.md, "Space taken by pushes"). A placement pushes step N only
// once N is committed on every node (each node's leader writes its copy of the version files, the
// commit record among them, before any rank pushes), after its own ranks placed their objects of N:
// so a push into a step for which this node holds neither an object of its own ranks nor a version
// file cannot become a version here, and is refused before anything touches the disk.
#pragma once

#include <cstdint>
#include <string>

#include "transfer_policy.hpp"

namespace flashpoint {
namespace xfer {

// An object pushed without a size from this node's commit records may be at most this many times
// the same-named object of the newest older version on this node (no such object: no bound here).
constexpr uint64_t kUnrecordedGrowthLimit = 8;

// Why a push of size bytes into dir_name/file_name (a layout path the policy parsed, of step) is
// refused by the rules above; empty when it is not. size_recorded: a commit record of this node
// lists the path (its size was checked against it). Reads only directories under base_fd.
std::string refuse_push_into_version(int base_fd, const TransferPolicy& policy, const std::string& dir_name,
                                     const std::string& file_name, uint64_t step, uint64_t size, bool size_recorded,
                                     bool* too_large);

}  // namespace xfer
}  // namespace flashpoint
