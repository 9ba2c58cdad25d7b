#include "prefetch/resident_marks.h"

namespace cubetorchfs::prefetch {

std::optional<ResidentMarks::Mark> ResidentMarks::Mark::Unpack(uint64_t packed) {
  if (packed == 0) return std::nullopt;
  Mark m;
  m.version = static_cast<uint32_t>(packed);
  m.seq = static_cast<uint32_t>(packed >> 32) & kSeqMask;
  m.probing = (packed >> 63) != 0;
  return m;
}

uint64_t ResidentMarks::Mark::OfEarlierProcess(uint64_t packed) {
  std::optional<Mark> m = Unpack(packed);
  if (!m) return 0;
  m->probing = false;
  // Half the sequence space behind this process's first marks (from 1): not after them.
  m->seq = kSeqMask;
  return m->Pack();
}

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

ResidentMarks::Mark ResidentMarks::Make(const cfs_client::FileVersion& version, uint64_t now) {
  SampleReclaim(now);
  Mark mark;
  mark.version = VersionTag(version);
  mark.seq = next_seq_;
  next_seq_ = (next_seq_ & kSeqMask) == kSeqMask ? 1 : next_seq_ + 1;
  return mark;
}

void ResidentMarks::SampleReclaim(uint64_t now) {
  if (!options_.reclaim_counter) return;
  if (reclaim_sampled_ && now - reclaim_sampled_ns_ < kReclaimSampleNs) return;
  const std::optional<uint64_t> c = options_.reclaim_counter();
  if (!reclaim_sampled_ || !c || !last_reclaim_ || *c != *last_reclaim_) {
    // The first sample (what came before is unknown), a counter that cannot be read, or
    // pages reclaimed since the last sample: only marks made from now on are trusted.
    trust_from_ = c ? std::optional<uint32_t>(next_seq_) : std::nullopt;
  }
  last_reclaim_ = c;
  reclaim_sampled_ = true;
  reclaim_sampled_ns_ = now;
}

bool ResidentMarks::Trusted(const Mark& mark, uint64_t now) {
  SampleReclaim(now);
  return trust_from_ && (mark.seq == *trust_from_ || SeqAfter(mark.seq, *trust_from_));
}

bool ResidentMarks::NoteDrop(uint64_t now, bool ahead) {
  drops_++;
  if (!ahead) return false;
  drop_times_.push_back(now);
  if (drop_times_.size() > kPressureDrops) drop_times_.pop_front();
  if (drop_times_.size() < kPressureDrops || now - drop_times_.front() > kPressureSpanNs)
    return false;
  const bool entering = !Pressure(now);
  pressure_until_ns_ = now + kPressureHoldNs;
  return entering;
}

}  // namespace cubetorchfs::prefetch
