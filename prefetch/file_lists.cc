#include "prefetch/file_lists.h"

#include <algorithm>

#include "common/logging.h"

namespace cubetorchfs::prefetch {

namespace {

constexpr uint64_t kSweepEveryNs = 1'000'000'000;

// The capacity a block of `have` bytes grows to for `need`: by half again at least, so that
// appends in pieces cost amortized O(1), and no more than asked when that is larger.
uint64_t Grown(uint64_t have, uint64_t need) {
  return need <= have ? have : std::max(need, have + have / 2);
}

}  // namespace

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
  list.offsets.push_back(0);  // entry i spans offsets[i] .. offsets[i + 1]
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
  uint64_t add = 0;
  for (const auto& e : entries) add += e.size();
  MutexLock l(mu_);
  const uint64_t now = clock_->NowNanos();
  Op op = Op::kOk;
  List* list = FindLocked(uid, id, now, &op);
  if (list == nullptr) return op;
  const uint64_t count = list->offsets.size() - 1;
  *first = count;
  *size = count;
  if (count + entries.size() > kMaxEntries) {
    *why = "a list holds at most " + std::to_string(kMaxEntries) + " entries";
    return Op::kFull;
  }
  // Offsets are 32-bit: a list's paths fit in 4 GiB (the byte limits are lower anyway).
  if (list->bytes.size() + add > UINT32_MAX) {
    *why = "a list's paths fit in 4 GiB";
    return Op::kFull;
  }
  const uint64_t bytes_cap = Grown(list->bytes.capacity(), list->bytes.size() + add);
  const uint64_t offsets_cap =
      Grown(list->offsets.capacity(), list->offsets.size() + entries.size());
  const uint64_t charge = bytes_cap + offsets_cap * sizeof(uint32_t);
  const uint64_t more = charge > list->charged ? charge - list->charged : 0;
  while (use_[list->uid].bytes + more > options_.max_bytes_per_uid &&
         EvictOneLocked(list->uid, id)) {
  }
  Use& u = use_[list->uid];
  if (u.bytes + more > options_.max_bytes_per_uid) {
    *why = "this user's file lists would take more than prefetch.max_list_bytes_per_uid (" +
           std::to_string(options_.max_bytes_per_uid) + " bytes; " + std::to_string(u.bytes) +
           " held, " + std::to_string(more) + " more asked)";
    return Op::kFull;
  }
  if (bytes_ + more > options_.max_bytes) {
    *why = "the file lists of all users would take more than prefetch.max_list_bytes (" +
           std::to_string(options_.max_bytes) + " bytes; " + std::to_string(bytes_) + " held, " +
           std::to_string(more) + " more asked)";
    return Op::kFull;
  }
  list->bytes.reserve(bytes_cap);
  list->offsets.reserve(offsets_cap);
  for (const auto& e : entries) {
    list->bytes.append(e);
    list->offsets.push_back(static_cast<uint32_t>(list->bytes.size()));
  }
  const uint64_t charged = Charge(*list);
  u.bytes = u.bytes - list->charged + charged;
  bytes_ = bytes_ - list->charged + charged;
  list->charged = charged;
  list->last_used_ns = now;
  *size = list->offsets.size() - 1;
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
                               uint64_t* refused, uint64_t* size) {
  MutexLock l(mu_);
  Op op = Op::kOk;
  List* list = FindLocked(uid, id, clock_->NowNanos(), &op);
  if (list == nullptr) return op;
  *size = list->offsets.size() - 1;
  for (uint32_t p : positions)
    if (p >= *size) return Op::kRange;
  list->last_used_ns = clock_->NowNanos();
  out->reserve(out->size() + positions.size());
  const char* base = list->bytes.data();
  for (uint32_t p : positions) {
    const uint32_t from = list->offsets[p], to = list->offsets[p + 1];
    if (from == to) {
      ++*refused;
      continue;
    }
    out->emplace_back(base + from, to - from);
  }
  return Op::kOk;
}

FileLists::Stats FileLists::GetStats(std::optional<uid_t> only) {
  MutexLock l(mu_);
  Stats s;
  for (const auto& [id, list] : lists_) {
    if (only && list.uid != *only) continue;
    s.lists++;
    s.entries += list.offsets.size() - 1;
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
