// Prefetcher, part 3: what the daemon knows of the kernel's page cache. Files the kernel
// holds are passed over (marked resident), probed again as the readers near them, and, under
// page pressure, put into the LRU cache if the kernel dropped them. See docs/prefetch.md.
#include <prometheus/counter.h>

#include <algorithm>

#include "common/logging.h"
#include "prefetch/prefetcher.h"

namespace cubetorchfs::prefetch {

uint64_t Prefetcher::RecheckLead() const {
  // Room to fetch what has gone since: twice what the workers fetch at once.
  return 2 * std::max<uint64_t>(options_.prefetch.max_inflight, 1);
}

std::optional<Prefetcher::Job> Prefetcher::RecheckLocked(Stream& s) {
  if (!page_probe_) return std::nullopt;
  // Files passed over are probed again as the readers come near: the first probe may have
  // been a whole window ahead.
  const uint64_t end = std::min({s.high + RecheckLead(), s.next, s.base + s.paths.size()});
  s.recheck = std::max(s.recheck, s.low);
  while (s.recheck < end) {
    const uint64_t pos = s.recheck++;
    uint8_t& state = s.states[pos - s.base];
    if ((state & kStateMask) != kPending || (state & kProbed) == 0 || (state & kRechecked) != 0)
      continue;
    state |= kRechecked;
    const std::string& path = s.paths[pos - s.base];
    cfs_client::FileVersion version;
    std::optional<Mark> mark = FreshMarkLocked(path, &version);
    if (!mark) {  // its attributes expired or changed meanwhile: fetch it
      UnprobeLocked(s, pos);
      continue;
    }
    if (std::optional<Job> job =
            PassOverJobLocked(s, path, *mark, version, /*near=*/true, /*restore=*/false))
      return job;
  }
  return std::nullopt;
}

std::optional<Prefetcher::Job> Prefetcher::PassOverJobLocked(const Stream& s,
                                                             const std::string& path,
                                                             const Mark& mark,
                                                             const cfs_client::FileVersion& version,
                                                             bool near, bool restore) {
  const uint64_t now = clock_->NowNanos();
  if (near && marks_.Pressure(now)) return LruFillJobLocked(s, path, version);
  if (mark.probing) return std::nullopt;  // a probe of it runs: its answer serves this position
  if (marks_.Trusted(mark, now)) {
    // No page-cache page was reclaimed since the kernel was served the file, as far as the
    // kernel counts. Proactive reclaim is not counted: DAMON's pageout scheme (on this
    // project's VMs: page cache unused for 60 s) dropped 2-40 % of a warm epoch's files
    // with pgsteal at 0. So a file the daemon still holds (RAM or NVMe) is put back into the
    // page cache as the stream reaches it, at a store's cost of no request; one it does not
    // hold is trusted, and if its pages went all the same its reader reads it from the daemon.
    totals_.trusted++;
    if (trusted_) trusted_->Increment();
    // Once, when the stream first reaches the file (a window ahead of the readers at most:
    // well within any reclaim's idea of unused), not again as they come near.
    if (!restore || !restore_ || version.size == 0 || version.size > options_.chunk_bytes)
      return std::nullopt;
    rr_after_ = s.id;
    Job job{path, false, version.size};
    job.restore = true;
    job.version = version;
    job.probe_to = page_probe_;
    return job;
  }
  Mark probing = mark;
  probing.probing = true;
  SetMarkLocked(path, probing);
  rr_after_ = s.id;
  return Job{path, true, version.size};
}

std::optional<Prefetcher::Job> Prefetcher::LruFillJobLocked(
    const Stream& s, const std::string& path, const cfs_client::FileVersion& version) {
  // The file goes to the LRU cache, not the window, where the read finds it: a file the kernel
  // serves would hold a window entry till the readers were far past. RunLruFill reads it from
  // the store only if the kernel and the daemon's tiers both lack it. Large files are left to
  // their reads.
  if (version.size > options_.chunk_bytes) return std::nullopt;
  rr_after_ = s.id;
  Job job{path, false, version.size};
  job.fill_lru = true;
  job.version = version;
  job.reader = s.reader;
  return job;
}

void Prefetcher::UnprobeLocked(Stream& s, uint64_t pos) {
  s.states[pos - s.base] &= static_cast<uint8_t>(~(kProbed | kRechecked));
  s.next = std::min(s.next, pos);
  s.recheck = std::min(s.recheck, pos);
}

std::optional<Prefetcher::Mark> Prefetcher::FreshMarkLocked(const std::string& path,
                                                            cfs_client::FileVersion* version) {
  if (attr_source_ == nullptr) return std::nullopt;
  // Only at the version of attributes still fresh: once they expire, the kernel asks again
  // and drops its pages if the file changed.
  std::optional<cfs_client::FileAttr> attr;
  const std::optional<Mark> m = Mark::Unpack(attr_source_->MarkOf(path, &attr));
  if (!m) return std::nullopt;
  if (attr && ResidentMarks::VersionTag(attr->Version()) == m->version) {
    *version = attr->Version();
    return m;
  }
  attr_source_->SetMark(path, 0);
  return std::nullopt;
}

std::optional<Prefetcher::Mark> Prefetcher::MarkLocked(const std::string& path) const {
  if (attr_source_ == nullptr) return std::nullopt;
  return Mark::Unpack(attr_source_->MarkOf(path, nullptr));
}

void Prefetcher::SetMarkLocked(const std::string& path, const std::optional<Mark>& mark) {
  if (attr_source_ != nullptr) attr_source_->SetMark(path, mark ? mark->Pack() : 0);
}

void Prefetcher::MarkResidentLocked(const std::string& path,
                                    const cfs_client::FileVersion& version) {
  if (!marks_.enabled() || attr_source_ == nullptr) return;
  attr_source_->SetMark(path, marks_.Make(version, clock_->NowNanos()).Pack());
}

void Prefetcher::NotePageDropLocked(uint64_t now, bool ahead) {
  if (!marks_.NoteDrop(now, ahead)) return;  // pressure did not begin now
  // Files passed over and already rechecked near the readers are taken up again, to be put in the
  // LRU cache.
  for (auto& [id, s] : streams_) {
    const uint64_t end =
        std::min<uint64_t>({s.next, s.base + s.paths.size(), s.high + RecheckLead()});
    for (uint64_t pos = std::max(s.low, s.high); pos < end; ++pos) {
      uint8_t& state = s.states[pos - s.base];
      if ((state & kStateMask) != kPending || (state & kProbed) == 0) continue;
      state &= static_cast<uint8_t>(~kRechecked);
      s.recheck = std::min(s.recheck, pos);
    }
  }
  Wake();
}

void Prefetcher::NoteNotResidentLocked(const std::string& path, uint64_t now) {
  const std::optional<Mark> m = MarkLocked(path);
  if (!m) return;
  // Pressure is what the streams see ahead: a file one passed over as held, yet read from the
  // daemon before its position was reached. A read of a file in no stream, or of one the
  // window holds for its reader, says nothing of the files passed over.
  bool ahead = false;
  const uint64_t key = PathKey(path);
  for (const auto& [id, s] : streams_) {
    const std::optional<uint64_t> pos = s.FirstPending(key, path);
    if (pos && (s.states[*pos - s.base] & kProbed) != 0) {
      ahead = true;
      break;
    }
  }
  NotePageDropLocked(now, ahead);
  // The kernel was served this file whole, yet asks for it: its pages were dropped, maybe
  // after a probe found them. The page cache drops what it was served earliest first, so the
  // files passed over whose marks are older still may have gone the same way since their
  // probe: they are asked about again.
  SetMarkLocked(path, std::nullopt);
  bool again = false;
  for (auto& [id, s] : streams_) {
    // Only the files the readers are about to reach: the rest are rechecked as they come.
    const uint64_t end =
        std::min<uint64_t>({s.next, s.base + s.paths.size(), s.high + RecheckLead()});
    for (uint64_t pos = std::max(s.low, s.high); pos < end; ++pos) {
      if ((s.states[pos - s.base] & kProbed) == 0) continue;
      const std::optional<Mark> other = MarkLocked(s.paths[pos - s.base]);
      if (!other || ResidentMarks::Newer(*other, *m) || other->probing) continue;
      UnprobeLocked(s, pos);
      again = true;
    }
  }
  if (again) Wake();
}

}  // namespace cubetorchfs::prefetch
