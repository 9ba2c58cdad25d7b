#include "prefetch/resident_marks.h"

#include <functional>

namespace cubetorchfs::prefetch {

uint64_t ResidentMarks::Key(std::string_view path) { return std::hash<std::string_view>{}(path); }

uint64_t ResidentMarks::VersionDigest(const cfs_client::FileVersion& v) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (uint64_t x :
       {v.size, static_cast<uint64_t>(v.mtime_ns), v.id, static_cast<uint64_t>(v.ctime_ns)}) {
    h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  }
  return h;
}

void ResidentMarks::Make(uint64_t key, const cfs_client::FileVersion& version, uint64_t now) {
  if (options_.max_marks == 0) return;
  SampleReclaim(now);
  const uint64_t seq = next_seq_++;
  if (table_.Find(key) == nullptr)
    while (table_.size() >= options_.max_marks) DropOldest();
  // Made again in place (a restore re-marks every file of a warm epoch); its old place in
  // order_ is skipped (another seq).
  Mark& mark = table_.Insert(key);
  mark = Mark{};
  mark.version = VersionDigest(version);
  mark.seq = seq;
  order_.emplace_back(seq, key);
  if (order_.size() > 2 * table_.size() + 1024) {
    // Most entries are of marks gone or made again since: keep the live ones, in order.
    std::deque<std::pair<uint64_t, uint64_t>> live;
    for (const auto& [sq, k] : order_) {
      const Mark* m = table_.Find(k);
      if (m != nullptr && m->seq == sq) live.emplace_back(sq, k);
    }
    order_.swap(live);
  }
}

void ResidentMarks::DropOldest() {
  while (!order_.empty()) {
    const auto [seq, key] = order_.front();
    order_.pop_front();
    const Mark* m = table_.Find(key);
    if (m != nullptr && m->seq == seq) {
      table_.Erase(key);
      return;
    }
  }
}

void ResidentMarks::SampleReclaim(uint64_t now) {
  if (!options_.reclaim_counter) return;
  if (reclaim_sampled_ && now - reclaim_sampled_ns_ < kReclaimSampleNs) return;
  const std::optional<uint64_t> c = options_.reclaim_counter();
  if (!reclaim_sampled_ || !c || !last_reclaim_ || *c != *last_reclaim_) {
    // The first sample (what came before is unknown), a counter that cannot be read, or
    // pages reclaimed since the last sample: only marks made from now on are trusted.
    trust_from_seq_ = c ? next_seq_ : UINT64_MAX;
  }
  last_reclaim_ = c;
  reclaim_sampled_ = true;
  reclaim_sampled_ns_ = now;
}

bool ResidentMarks::Trusted(const Mark& mark, uint64_t now) {
  SampleReclaim(now);
  return mark.seq >= trust_from_seq_;
}

bool ResidentMarks::NoteDrop(uint64_t now) {
  drops_++;
  drop_times_.push_back(now);
  if (drop_times_.size() > kPressureDrops) drop_times_.pop_front();
  if (drop_times_.size() < kPressureDrops || now - drop_times_.front() > kPressureSpanNs)
    return false;
  const bool entering = !Pressure(now);
  pressure_until_ns_ = now + kPressureHoldNs;
  return entering;
}

}  // namespace cubetorchfs::prefetch
