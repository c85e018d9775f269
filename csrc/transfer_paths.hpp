// Confined filesystem access of the transfer service: every path a peer names is opened
// component by component with O_NOFOLLOW under the base directory, never resolved by the kernel.
#pragma once

#include <string>
#include <vector>

#include "transfer_wire.hpp"

namespace flashpoint {
namespace xfer {

// Opens (and with create, makes) the directories comps[0..count-1] under base_fd, confined.
Fd open_confined_dirs(int base_fd, const std::vector<std::string>& comps, size_t count, const std::string& path,
                      bool create);
// The directory that holds the object at comps (every component but the last), confined.
Fd open_parent_dir(int base_fd, const std::vector<std::string>& comps, const std::string& path, bool create);
// The spare directory (relative to base_fd), confined; an empty Fd when there is none.
Fd open_spare_dir(int base_fd, const std::string& spare_dir);
// Opens an existing regular file under base_fd for reading, confined; *size_out is its size.
// refuse_hard_links: a file with more than one link is refused (what a server serves to peers).
Fd open_confined_for_read(int base_fd, const std::string& path, uint64_t* size_out, bool refuse_hard_links = false);
// Opens a base directory given by the caller (not by a peer).
Fd open_base_dir(const std::string& dir);

}  // namespace xfer
}  // namespace flashpoint
