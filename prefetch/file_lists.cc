#include "prefetch/file_lists.h"

#include <algorithm>
#include <cstring>

#include "common/logging.h"

namespace cubetorchfs::prefetch {

namespace {

constexpr uint64_t kSweepEveryNs = 1'000'000'000;

// The capacity a block of `have` bytes grows to for `need`: by an eighth again at least, so
// that appends in pieces cost amortized O(1) (the kernel moves the pages of a MappedBuffer:
// no byte is copied) while at most an eighth of what is charged is room not yet used; no
// more than asked when that is larger.
uint64_t Grown(uint64_t have, uint64_t need) {
  return need <= have ? have : std::max(need, have + have / 8);
}

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// REQUIRES: a varint written by PutVarint at *p (the list's own bytes).
uint64_t GetVarint(const char** p) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const auto b = static_cast<uint8_t>(*(*p)++);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return v;
  }
}

}  // namespace

void FileLists::Encode(uint64_t entries_before, std::string* last,
                       const std::vector<std::string>& entries, std::string* out,
                       uint64_t* new_blocks) {
  uint64_t n = entries_before;
  for (const std::string& e : entries) {
    size_t prefix = 0, suffix = 0;
    if (n % kBlock == 0) {
      ++*new_blocks;  // a block starts: the entry whole
    } else {
      const size_t most = std::min(e.size(), last->size());
      while (prefix < most && e[prefix] == (*last)[prefix]) ++prefix;
      // The tail it shares too (".JPEG"), in what is left past the prefix of both.
      while (suffix < most - prefix &&
             e[e.size() - 1 - suffix] == (*last)[last->size() - 1 - suffix])
        ++suffix;
    }
    const size_t middle = e.size() - prefix - suffix;
    PutVarint(prefix, out);
    PutVarint(suffix, out);
    PutVarint(middle, out);
    out->append(e, prefix, middle);
    *last = e;
    ++n;
  }
}

void FileLists::Decode(const List& list, uint64_t p, std::string* out, std::string* before) {
  uint32_t start = 0;
  std::memcpy(&start, list.blocks.data() + p / kBlock * sizeof(uint32_t), sizeof start);
  const char* at = list.bytes.data() + start;
  out->clear();
  for (uint64_t i = p - p % kBlock; i <= p; ++i) {
    const uint64_t prefix = GetVarint(&at);
    const uint64_t suffix = GetVarint(&at);
    const uint64_t middle = GetVarint(&at);
    out->swap(*before);  // the entry before this one
    out->assign(*before, 0, prefix);
    out->append(at, middle);
    out->append(*before, before->size() - suffix, suffix);
    at += middle;
  }
}

FileLists::FileLists(const Options& options, Clock* clock) : options_(options), clock_(clock) {}

std::string FileLists::Create(uid_t uid) {
  MutexLock l(mu_);
  const uint64_t now = clock_->NowNanos();
  SweepLocked(now);
  // At its limit, the user's least recently used list goes (a publisher that died left it;
  // a live one registers again): a user's limits never cost another user anything.
  while (use_[uid].lists >= options_.max_lists_per_uid && EvictOneLocked(uid, "")) {
  }
  Use& u = use_[uid];
  if (u.lists >= options_.max_lists_per_uid) {
    if (u.lists == 0) use_.erase(uid);
    return "";
  }
  std::string id = std::to_string(next_id_++);
  id.insert(id.begin(), 'l');
  List& list = lists_[id];
  list.uid = uid;
  list.charged = Charge(list);
  list.last_used_ns = now;
  u.lists++;
  u.bytes += list.charged;
  bytes_ += list.charged;
  return id;
}

FileLists::List* FileLists::FindLocked(uid_t uid, const std::string& id, uint64_t now, Op* op) {
  SweepLocked(now);
  auto it = lists_.find(id);
  if (it == lists_.end()) {
    *op = Op::kNotFound;
    return nullptr;
  }
  if (uid != 0 && it->second.uid != uid) {
    *op = Op::kForbidden;
    return nullptr;
  }
  *op = Op::kOk;
  return &it->second;
}

FileLists::Op FileLists::Append(uid_t uid, const std::string& id,
                                const std::vector<std::string>& entries, uint64_t* first,
                                uint64_t* size, std::string* why) {
  MutexLock l(mu_);
  const uint64_t now = clock_->NowNanos();
  Op op = Op::kOk;
  List* list = FindLocked(uid, id, now, &op);
  if (list == nullptr) return op;
  const uint64_t count = list->entries;
  *first = count;
  *size = count;
  if (count + entries.size() > kMaxEntries) {
    *why = "a list holds at most " + std::to_string(kMaxEntries) + " entries";
    return Op::kFull;
  }
  // Coded apart first, so that a refusal changes nothing.
  std::string last = list->last;
  std::string add;
  uint64_t new_blocks = 0;
  Encode(count, &last, entries, &add, &new_blocks);
  // Block offsets are 32-bit: a list's coding fits in 4 GiB (the byte limits are lower anyway).
  if (list->bytes.size() + add.size() > UINT32_MAX) {
    *why = "a list's paths fit in 4 GiB";
    return Op::kFull;
  }
  const uint64_t bytes_cap =
      MappedBuffer::Rounded(Grown(list->bytes.capacity(), list->bytes.size() + add.size()));
  const uint64_t blocks_cap = MappedBuffer::Rounded(
      Grown(list->blocks.capacity(), list->blocks.size() + new_blocks * sizeof(uint32_t)));
  const uint64_t charge = bytes_cap + blocks_cap + std::max(last.capacity(), list->last.capacity());
  const uint64_t more = charge > list->charged ? charge - list->charged : 0;
  // Past any limit, the user's own least recently used other lists go first. The global
  // bytes are shared as queued paths are: with k users holding lists (this one counted), one
  // may hold a (k + 1)-th of them, so that a user with none always finds a share.
  const uint64_t users = UsersLocked(list->uid);
  const uint64_t share = options_.max_bytes / (users + 1);
  while ((use_[list->uid].bytes + more > options_.max_bytes_per_uid ||
          use_[list->uid].bytes + more > share || bytes_ + more > options_.max_bytes) &&
         EvictOneLocked(list->uid, id)) {
  }
  Use& u = use_[list->uid];
  if (u.bytes + more > options_.max_bytes_per_uid) {
    *why = "this user's file lists would take more than prefetch.max_list_bytes_per_uid (" +
           std::to_string(options_.max_bytes_per_uid) + " bytes; " + std::to_string(u.bytes) +
           " held, " + std::to_string(more) + " more asked)";
    return Op::kFull;
  }
  if (u.bytes + more > share) {
    *why = "this user's fair share of the file lists of all users is used (with " +
           std::to_string(users) + " users holding lists, each may have 1/" +
           std::to_string(users + 1) + " of prefetch.max_list_bytes: " + std::to_string(share) +
           " bytes; " + std::to_string(u.bytes) + " held, " + std::to_string(more) + " more asked)";
    return Op::kFull;
  }
  if (bytes_ + more > options_.max_bytes) {
    *why = "the file lists of all users would take more than prefetch.max_list_bytes (" +
           std::to_string(options_.max_bytes) + " bytes; " + std::to_string(bytes_) + " held, " +
           std::to_string(more) + " more asked)";
    return Op::kFull;
  }
  if (!list->bytes.Reserve(bytes_cap) || !list->blocks.Reserve(blocks_cap)) {
    *why = "the daemon has no memory for " + std::to_string(bytes_cap + blocks_cap) +
           " bytes of file list";
    return Op::kFull;
  }
  // The blocks started by these entries: where each one's first entry's coding begins.
  const char* at = add.data();
  for (uint64_t n = count; n < count + entries.size(); ++n) {
    if (n % kBlock == 0) {
      const auto start = static_cast<uint32_t>(list->bytes.size() + (at - add.data()));
      list->blocks.Append(&start, sizeof start);
    }
    GetVarint(&at);  // the lengths of the prefix and the suffix shared
    GetVarint(&at);
    const uint64_t middle = GetVarint(&at);
    at += middle;
  }
  list->bytes.Append(add.data(), add.size());
  list->entries += entries.size();
  list->refused += static_cast<uint64_t>(std::count_if(
      entries.begin(), entries.end(), [](const std::string& e) { return e.empty(); }));
  list->last.swap(last);
  const uint64_t charged = Charge(*list);
  u.bytes = u.bytes - list->charged + charged;
  bytes_ = bytes_ - list->charged + charged;
  list->charged = charged;
  list->last_used_ns = now;
  *size = list->entries;
  return Op::kOk;
}

void FileLists::EraseLocked(std::map<std::string, List>::iterator it) {
  auto u = use_.find(it->second.uid);
  if (u != use_.end()) {
    u->second.bytes -= it->second.charged;
    if (--u->second.lists == 0) use_.erase(u);
  }
  bytes_ -= it->second.charged;
  lists_.erase(it);
}

uint64_t FileLists::UsersLocked(uid_t uid) const {
  uint64_t users = 0;
  bool counted = false;
  for (const auto& [who, use] : use_) {
    if (use.bytes == 0 && who != uid) continue;  // empty lists hold nothing of the pool
    ++users;
    counted = counted || who == uid;
  }
  return users + (counted ? 0 : 1);
}

bool FileLists::EvictOneLocked(uid_t uid, const std::string& keep) {
  auto victim = lists_.end();
  for (auto it = lists_.begin(); it != lists_.end(); ++it)
    if (it->second.uid == uid && it->first != keep &&
        (victim == lists_.end() || it->second.last_used_ns < victim->second.last_used_ns))
      victim = it;
  if (victim == lists_.end()) return false;
  CTFS_LOG(kInfo) << "file list " << victim->first << " of uid " << uid
                  << " dropped: the user's least recently used, at its limits";
  EraseLocked(victim);
  return true;
}

FileLists::Op FileLists::Delete(uid_t uid, const std::string& id) {
  MutexLock l(mu_);
  auto it = lists_.find(id);
  if (it == lists_.end()) return Op::kNotFound;
  if (uid != 0 && it->second.uid != uid) return Op::kForbidden;
  EraseLocked(it);
  return Op::kOk;
}

FileLists::Op FileLists::Paths(uid_t uid, const std::string& id,
                               std::span<const uint32_t> positions, std::vector<std::string>* out,
                               uint64_t* refused, uint64_t* size, const Bound& bound, Over* over) {
  MutexLock l(mu_);
  Op op = Op::kOk;
  List* list = FindLocked(uid, id, clock_->NowNanos(), &op);
  if (list == nullptr) return op;
  *size = list->entries;
  for (uint32_t p : positions)
    if (p >= *size) return Op::kRange;
  list->last_used_ns = clock_->NowNanos();
  // Every position names a path when the list refused none: their number alone tells.
  if (list->refused == 0 && positions.size() > bound.paths) {
    if (over != nullptr) *over = Over{positions.size(), 0, true};
    return Op::kOver;
  }
  // Decoded within the bound: a request naming a long path many times holds no more than
  // what it could queue before it is refused.
  const size_t had = out->size();
  out->reserve(had + static_cast<size_t>(std::min<uint64_t>(positions.size(), bound.paths)));
  uint64_t paths = 0, bytes = 0, gone = 0;
  std::string entry, before;
  for (uint32_t p : positions) {
    Decode(*list, p, &entry, &before);
    if (entry.empty()) {
      ++gone;
      continue;
    }
    ++paths;
    bytes += bound.cost != nullptr ? bound.cost(entry.size()) : entry.size();
    if (paths > bound.paths || bytes > bound.bytes) {
      if (over != nullptr) *over = Over{paths, bytes, false};
      out->resize(had);
      return Op::kOver;
    }
    out->push_back(entry);
  }
  *refused += gone;
  return Op::kOk;
}

FileLists::Stats FileLists::GetStats(std::optional<uid_t> only) {
  MutexLock l(mu_);
  Stats s;
  for (const auto& [id, list] : lists_) {
    if (only && list.uid != *only) continue;
    s.lists++;
    s.entries += list.entries;
    s.bytes += list.charged;
  }
  return s;
}

void FileLists::Sweep() {
  MutexLock l(mu_);
  last_sweep_ns_ = 0;
  SweepLocked(clock_->NowNanos());
}

void FileLists::SweepLocked(uint64_t now) {
  if (last_sweep_ns_ != 0 && now - last_sweep_ns_ < kSweepEveryNs) return;
  last_sweep_ns_ = now;
  const auto idle_ns = static_cast<uint64_t>(options_.idle_s * 1e9);
  for (auto it = lists_.begin(); it != lists_.end();) {
    if (now - it->second.last_used_ns < idle_ns) {
      ++it;
      continue;
    }
    CTFS_LOG(kInfo) << "file list " << it->first << " of uid " << it->second.uid
                    << " expired (unused for " << options_.idle_s << " s)";
    EraseLocked(it++);
  }
}

}  // namespace cubetorchfs::prefetch
