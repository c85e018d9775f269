// Authorization of a transfer server (see transfer_policy.hpp).
#include "transfer_policy.hpp"

#include <algorithm>
#include <stdexcept>

#include "transfer_wire.hpp"

namespace flashpoint {

using xfer::quoted;

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string rank_list(const std::set<uint32_t>& ranks) {
  std::string out;
  for (uint32_t r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out.empty() ? "none" : out;
}

// A plain file name a peer may name inside a version directory.
bool plain_name(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

// --- NamePattern -----------------------------------------------------------------------------

NamePattern::NamePattern(const std::string& pattern, const std::vector<std::string>& fields) : text_(pattern) {
  auto bad = [&](const std::string& why) -> void {
    throw std::invalid_argument("name pattern " + quoted(pattern) + ": " + why);
  };
  if (pattern.empty() || pattern.size() > 255) bad("it must have 1 to 255 characters");
  std::vector<int> used(fields.size(), 0);
  std::string literal;
  auto end_literal = [&] {
    if (literal.empty()) return;
    if (!pieces_.empty() && is_digit(literal[0])) bad("a literal after a field must not start with a digit");
    pieces_.push_back({literal, 0, 0});
    literal.clear();
  };
  for (size_t i = 0; i < pattern.size();) {
    const char c = pattern[i];
    if (c != '{') {
      if (c == '}' || c == '/' || c <= ' ' || c > '~') bad("literals are printable ASCII without '/', '{', '}', space");
      literal += c;
      ++i;
      continue;
    }
    end_literal();
    const size_t close = pattern.find('}', i);
    if (close == std::string::npos) bad("a '{' is not closed");
    const std::string spec = pattern.substr(i + 1, close - i - 1);
    const size_t colon = spec.find(':');
    const std::string name = spec.substr(0, colon);
    int width = 0;
    if (colon != std::string::npos) {
      const std::string fmt = spec.substr(colon + 1);  // "0<width>d"
      const bool digits = fmt.size() >= 3 && fmt.size() <= 4 && fmt[0] == '0' && fmt.back() == 'd' &&
                          std::all_of(fmt.begin() + 1, fmt.end() - 1, is_digit);
      if (!digits) bad("a field's format must be 0<width>d, as in {rank:05d}");
      width = std::stoi(fmt.substr(1, fmt.size() - 2));
      if (width < 1 || width > 20) bad("a field's width must be in 1..20");
    }
    const auto it = std::find(fields.begin(), fields.end(), name);
    if (it == fields.end()) bad("unknown field " + quoted(name));
    const size_t f = static_cast<size_t>(it - fields.begin());
    if (used[f]++) bad("field " + quoted(name) + " appears twice");
    if (!pieces_.empty() && pieces_.back().literal.empty()) bad("two fields must be separated by a literal");
    pieces_.push_back({"", f, width});
    i = close + 1;
  }
  end_literal();
  for (size_t f = 0; f < fields.size(); ++f)
    if (!used[f]) bad("field {" + fields[f] + "} is missing");
}

bool NamePattern::match(const std::string& name, uint64_t* values) const {
  size_t p = 0;
  for (const Piece& piece : pieces_) {
    if (!piece.literal.empty()) {
      if (name.compare(p, piece.literal.size(), piece.literal) != 0) return false;
      p += piece.literal.size();
      continue;
    }
    size_t q = p;
    while (q < name.size() && is_digit(name[q])) ++q;
    if (q == p || q - p > 20) return false;
    uint64_t v = 0;
    for (size_t k = p; k < q; ++k) {
      const uint64_t d = static_cast<uint64_t>(name[k] - '0');
      if (v > (UINT64_MAX - d) / 10) return false;
      v = v * 10 + d;
    }
    std::string canonical = std::to_string(v);
    if (canonical.size() < static_cast<size_t>(piece.width))
      canonical.insert(0, static_cast<size_t>(piece.width) - canonical.size(), '0');
    if (name.compare(p, q - p, canonical) != 0) return false;  // e.g. step-07, rank-000001
    values[piece.field] = v;
    p = q;
  }
  return p == name.size();
}

// --- TransferPolicy --------------------------------------------------------------------------

TransferPolicy::TransferPolicy(const TransferPolicyConfig& config)
    : config_(config),
      version_dir_(config.version_dir_pattern, {"step"}),
      object_name_(config.object_name_pattern, {"rank", "index"}) {
  if (config_.world_size == 0) throw std::invalid_argument("world_size must be >= 1");
  auto check_rank = [&](uint32_t r, const char* what) {
    if (r >= config_.world_size)
      throw std::invalid_argument(std::string(what) + " " + std::to_string(r) + " is not below world_size " +
                                  std::to_string(config_.world_size));
  };
  for (uint32_t r : config_.own_ranks) {
    check_rank(r, "own rank");
    own_ranks_.insert(r);
  }
  for (const std::string& name : config_.version_files) {
    uint64_t values[2];
    if (!plain_name(name) || object_name_.match(name, values))
      throw std::invalid_argument("version file " + quoted(name) + " must be a plain file name that is no object name");
    version_files_.insert(name);
  }
  for (const auto& grant : config_.pushers) {
    check_rank(grant.first, "pushing rank");
    for (uint32_t r : grant.second) {
      check_rank(r, "object rank");
      if (own_ranks_.count(r))
        throw std::invalid_argument("rank " + std::to_string(grant.first) + " would push the objects of rank " +
                                    std::to_string(r) + ", which is on this node: a node never receives its own objects");
      pushers_[grant.first].insert(r);
    }
  }
}

std::string TransferPolicy::parse(const std::string& path, PolicyPath* out) const {
  const std::string expected = "peers name only " + version_dir_.text() + "/" + object_name_.text() +
                               " or a version file of a version directory";
  const size_t slash = path.find('/');
  if (slash == std::string::npos || path.find('/', slash + 1) != std::string::npos)
    return "not a path of the checkpoint layout: " + expected;
  const std::string dir = path.substr(0, slash), file = path.substr(slash + 1);
  uint64_t step = 0;
  if (!version_dir_.match(dir, &step)) return quoted(dir) + " is not a version directory: " + expected;
  out->step = step;
  uint64_t values[2] = {0, 0};
  if (object_name_.match(file, values)) {
    if (values[0] > UINT32_MAX) return "the rank of object " + quoted(file) + " is out of range";
    out->is_object = true;
    out->object_rank = static_cast<uint32_t>(values[0]);
    return "";
  }
  if (version_files_.count(file)) {
    out->is_object = false;
    return "";
  }
  std::string files;
  for (const std::string& f : version_files_) files += (files.empty() ? "" : ", ") + f;
  return quoted(file) + " is neither an object (" + object_name_.text() + ") nor a version file (" + files + ")";
}

std::string TransferPolicy::refuse_push(uint32_t client_rank, const std::string& path, PolicyPath* parsed) const {
  const std::string why = parse(path, parsed);
  if (!why.empty()) return why;
  if (!parsed->is_object)
    return "version files are never pushed: every node writes its own, and a node that lacks them fetches them";
  const std::string of_rank = "an object of rank " + std::to_string(parsed->object_rank);
  if (own_ranks_.count(parsed->object_rank)) return "it is " + of_rank + ", which lives on this node: peers never replace it";
  const auto grant = pushers_.find(client_rank);
  if (grant == pushers_.end())
    return "rank " + std::to_string(client_rank) + " replicates nothing to this rank (replication placement)";
  if (!grant->second.count(parsed->object_rank))
    return "rank " + std::to_string(client_rank) + " may push here only the objects of rank(s) " +
           rank_list(grant->second) + " (replication placement); this is " + of_rank;
  return "";
}

bool TransferPolicy::is_own_object(const std::string& name) const {
  uint64_t values[2] = {0, 0};
  return object_name_.match(name, values) && values[0] <= UINT32_MAX && own_ranks_.count(static_cast<uint32_t>(values[0]));
}

std::string TransferPolicy::refuse_fetch(uint32_t, const std::string& path) const {
  PolicyPath parsed;
  return parse(path, &parsed);
}

std::string TransferPolicy::describe() const {
  std::string pushers;
  for (const auto& g : pushers_) pushers += (pushers.empty() ? "" : ", ") + std::to_string(g.first) + ": [" + rank_list(g.second) + "]";
  return "TransferPolicy(world_size=" + std::to_string(config_.world_size) + ", own_ranks=[" + rank_list(own_ranks_) +
         "], pushers={" + pushers + "}, " + version_dir_.text() + "/" + object_name_.text() + ")";
}

// --- ExpectedSizes ---------------------------------------------------------------------------

void ExpectedSizes::expect(uint64_t step, std::map<std::string, uint64_t> sizes) {
  std::lock_guard<std::mutex> lk(m_);
  steps_[step] = std::move(sizes);
  while (steps_.size() > kMaxSteps) steps_.erase(steps_.begin());
}

std::string ExpectedSizes::refuse(const std::string& path, bool has_step, uint64_t step, uint64_t size) const {
  std::lock_guard<std::mutex> lk(m_);
  for (const auto& s : steps_) {
    const auto it = s.second.find(path);
    if (it == s.second.end()) continue;
    if (it->second == size) return "";
    return "it announces " + std::to_string(size) + " bytes, but this node's commit record of step " +
           std::to_string(s.first) + " lists " + std::to_string(it->second);
  }
  if (has_step && steps_.count(step))
    return "this node's commit record of step " + std::to_string(step) + " does not list it";
  return "";
}

bool ExpectedSizes::lists(const std::string& path) const {
  std::lock_guard<std::mutex> lk(m_);
  for (const auto& s : steps_)
    if (s.second.count(path)) return true;
  return false;
}

}  // namespace flashpoint
