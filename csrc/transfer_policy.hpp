// Authorization of a transfer server: which authenticated rank may push or fetch which path
// (docs/protocol.md, "Authorization"). The names themselves belong to the checkpoint layout
// (ml_flashpoint_nemo/core/layout.py): Python hands them over as str.format patterns, and the
// server decides every request here, without the GIL.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace flashpoint {

// A file name with decimal fields, exactly as Python's str.format writes it, e.g.
// "rank-{rank:05d}-{index}.fpo". A field is {name} or {name:0Nd}; literals are printable ASCII
// without '/', '{', '}'. A name matches only in the canonical form the pattern writes (no extra
// leading zeros), so each value has one name.
class NamePattern {
 public:
  NamePattern() = default;
  // fields: the names the pattern must use, each exactly once; std::invalid_argument otherwise.
  NamePattern(const std::string& pattern, const std::vector<std::string>& fields);
  // True if name is what the pattern writes; values[i] is then the value of fields[i].
  bool match(const std::string& name, uint64_t* values) const;
  const std::string& text() const { return text_; }

 private:
  struct Piece {
    std::string literal;  // a literal, or empty for a field
    size_t field = 0;     // index into the constructor's fields
    int width = 0;        // zero-padded to at least this many digits
  };
  std::vector<Piece> pieces_;
  std::string text_;
};

struct TransferPolicyConfig {
  uint32_t world_size = 0;                              // an authenticated rank is below it
  std::vector<uint32_t> own_ranks;                      // this node's ranks: never pushed here
  std::map<uint32_t, std::vector<uint32_t>> pushers;    // client rank -> ranks whose objects it pushes here
  std::string version_dir_pattern;                      // e.g. "step-{step}"
  std::string object_name_pattern;                      // e.g. "rank-{rank:05d}-{index}.fpo"
  std::vector<std::string> version_files;               // version-level files peers may fetch
};

// A request path the policy understood: <version dir>/<object or version file>.
struct PolicyPath {
  uint64_t step = 0;
  bool is_object = false;
  uint32_t object_rank = 0;
};

class TransferPolicy {
 public:
  explicit TransferPolicy(const TransferPolicyConfig& config);  // std::invalid_argument naming the problem

  uint32_t world_size() const { return config_.world_size; }
  // Why client_rank may not push path (empty: it may); *parsed is filled when the path is a layout path.
  std::string refuse_push(uint32_t client_rank, const std::string& path, PolicyPath* parsed) const;
  // Why client_rank may not fetch path (empty: it may).
  std::string refuse_fetch(uint32_t client_rank, const std::string& path) const;
  std::string describe() const;
  // True when name is a version directory's name; *step is then its step.
  bool version_step(const std::string& name, uint64_t* step) const { return version_dir_.match(name, step); }
  // True when name is an object written by one of this node's ranks.
  bool is_own_object(const std::string& name) const;
  // True when name is a version file (written by this node only: peers never push one).
  bool is_version_file(const std::string& name) const { return version_files_.count(name) != 0; }

 private:
  // Empty and *out filled when path is a layout path; else why not.
  std::string parse(const std::string& path, PolicyPath* out) const;

  TransferPolicyConfig config_;
  NamePattern version_dir_, object_name_;
  std::set<std::string> version_files_;
  std::set<uint32_t> own_ranks_;
  std::map<uint32_t, std::set<uint32_t>> pushers_;
};

// The sizes this node's commit records give for objects peers will push (relative path ->
// bytes), per step, the newest kMaxSteps steps kept. A push of a listed path must announce
// exactly its size; a push into a listed step of a path it does not list is refused.
class ExpectedSizes {
 public:
  static constexpr size_t kMaxSteps = 8;
  void expect(uint64_t step, std::map<std::string, uint64_t> sizes);
  // Why a push of size bytes to path (of step, when has_step) is refused; empty when it is not.
  std::string refuse(const std::string& path, bool has_step, uint64_t step, uint64_t size) const;
  // True when a commit record of this node lists path (its size is then checked by refuse).
  bool lists(const std::string& path) const;

 private:
  mutable std::mutex m_;
  std::map<uint64_t, std::map<std::string, uint64_t>> steps_;
};

}  // namespace flashpoint
