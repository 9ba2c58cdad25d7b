#include "cache/cache_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <unordered_set>

#include "cache/crc32c.h"
#include "common/logging.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace cubetorchfs::cache {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kMagic = 0x31414e4552414343ull;  // "CCARENA1"
constexpr uint32_t kLayout = 3;
constexpr uint32_t kLive = 0x4c495645;  // "EVIL" little-endian: a record in force
constexpr uint32_t kTypeShift = 30;
constexpr uint32_t kLowMask = (1u << kTypeShift) - 1;
enum SpanType : uint32_t { kFree = 0, kDataSpan = 1, kRecordSpan = 2, kRunHead = 3 };

struct Header {
  uint64_t magic;
  uint32_t layout;
  uint32_t span_bytes;
  uint64_t size;
  uint32_t nspans;
  uint32_t classes;
  uint64_t class_sig;
};

// A record: this, then the key's bytes.
struct Record {
  uint32_t magic;  // kLive while in force
  uint16_t key_len;
  uint16_t zero;
  uint32_t size;  // of the data: a block of the arena is a chunk, at most 1 GiB
  uint32_t crc;   // of key_len, size, data, seq and the key
  uint64_t data;  // offset of the data's block in the region
  uint64_t seq;   // the order of publication: the adopter caches the latest first
};
static_assert(sizeof(Record) == CacheArena::kRecordHeader);

uint64_t PageRound(uint64_t n) { return (n + kPage - 1) & ~(kPage - 1); }

// 16-byte steps up to a page, then whole pages up to kMaxSmall: a block wastes under 16 bytes
// below a page (a file of 1-3 KB costs its bytes, not an eighth more) and under a page above
// (under 4 % from 100 KB up). Classes are cheap: a span is taken only when its class is used,
// and only the pages written cost memory.
const std::vector<uint32_t>& ClassSizes() {
  static const std::vector<uint32_t> sizes = [] {
    std::vector<uint32_t> v;
    for (uint64_t s = 64; s < kPage; s += 16) v.push_back(static_cast<uint32_t>(s));
    for (uint64_t s = kPage; s <= CacheArena::kMaxSmall; s += kPage)
      v.push_back(static_cast<uint32_t>(s));
    return v;
  }();
  return sizes;
}

uint32_t ClassOf(size_t size) {
  const std::vector<uint32_t>& c = ClassSizes();
  return static_cast<uint32_t>(std::lower_bound(c.begin(), c.end(), size) - c.begin());
}

uint64_t ClassSig() {
  uint64_t h = 1469598103934665603ull;
  for (uint32_t s : ClassSizes()) h = (h ^ s) * 1099511628211ull;
  return h;
}

uint64_t MetaBytes(uint64_t size) {
  const uint64_t table = kPage + 4 * (size / CacheArena::kSpan);
  return (table + CacheArena::kSpan - 1) / CacheArena::kSpan * CacheArena::kSpan;
}

uint32_t RecordCrc(const Record& r, const char* key) {
  uint32_t crc = Crc32c(&r.key_len, sizeof r.key_len);
  crc = Crc32c(&r.size, sizeof r.size, crc);
  crc = Crc32c(&r.data, sizeof r.data + sizeof r.seq, crc);
  static_assert(offsetof(Record, seq) == offsetof(Record, data) + sizeof(uint64_t));
  return Crc32c(key, r.key_len, crc);
}

}  // namespace

uint64_t CacheArena::ReserveFor(uint64_t cache_bytes) {
  const uint64_t want = std::min<uint64_t>(cache_bytes, uint64_t{16} << 40) * 4 + (1ull << 30);
  return (want + kSpan - 1) / kSpan * kSpan;
}

uint64_t CacheArena::BlockBytes(size_t size) {
  if (size > kMaxSmall) return PageRound(size);
  return ClassSizes()[ClassOf(size)];
}

CacheArena::CacheArena(DurableRegion region) : region_(std::move(region)) {
  base_ = region_.data();
  first_ = MetaBytes(region_.size());
  nspans_ = static_cast<uint32_t>((region_.size() - first_) / kSpan);
  const std::vector<uint32_t>& sizes = ClassSizes();
  for (auto& kind : classes_) {
    kind = std::make_unique<Class[]>(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      kind[i].size = sizes[i];
      kind[i].per_span = static_cast<uint32_t>(kSpan / sizes[i]);
    }
  }
  small_.resize(nspans_);
}

CacheArena::~CacheArena() = default;

Result<std::unique_ptr<CacheArena>> CacheArena::Create(uint64_t reserve_bytes) {
  reserve_bytes = std::max<uint64_t>(reserve_bytes, 8 * kSpan) / kSpan * kSpan;
  CTFS_ASSIGN_OR_RETURN(DurableRegion region,
                        DurableRegion::TryCreate("cubetorchfs-cache", reserve_bytes));
  std::unique_ptr<CacheArena> a(new CacheArena(std::move(region)));
  a->Format();
  return a;
}

void CacheArena::Format() {
  Header h{kMagic,         kLayout, static_cast<uint32_t>(kSpan),
           region_.size(), nspans_, static_cast<uint32_t>(ClassSizes().size()),
           ClassSig()};
  std::memcpy(base_, &h, sizeof h);
}

uint32_t CacheArena::Word(uint32_t span) const {
  auto* w = reinterpret_cast<uint32_t*>(base_ + kPage) + span;
  return std::atomic_ref<uint32_t>(*w).load(std::memory_order_acquire);
}

void CacheArena::SetWord(uint32_t span, uint32_t word) {
  auto* w = reinterpret_cast<uint32_t*>(base_ + kPage) + span;
  std::atomic_ref<uint32_t>(*w).store(word, std::memory_order_release);
}

void CacheArena::Punch(char* p, size_t len) {
  if (len == 0) return;
  if (region_.fd() >= 0) {
    ::fallocate(region_.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                static_cast<off_t>(p - base_), static_cast<off_t>(len));
  } else {
    ::madvise(p, len, MADV_DONTNEED);
  }
}

bool CacheArena::TakeSpans(uint32_t n, uint32_t* first) {
  MutexLock l(spans_mu_);
  for (auto it = free_runs_.begin(); it != free_runs_.end(); ++it) {
    if (it->second < n) continue;
    *first = it->first;
    const uint32_t rest = it->second - n;
    free_runs_.erase(it);
    if (rest > 0) free_runs_.emplace(*first + n, rest);
    spans_used_.fetch_add(n, std::memory_order_relaxed);
    return true;
  }
  if (uint64_t{top_} + n > nspans_) return false;
  *first = top_;
  top_ += n;
  spans_used_.fetch_add(n, std::memory_order_relaxed);
  return true;
}

// Spans whose pages were given back (Punch) and whose words are clear.
void CacheArena::GiveSpans(uint32_t first, uint32_t n) {
  MutexLock l(spans_mu_);
  spans_used_.fetch_sub(n, std::memory_order_relaxed);
  auto next = free_runs_.find(first + n);
  if (next != free_runs_.end()) {
    n += next->second;
    free_runs_.erase(next);
  }
  auto prev = free_runs_.lower_bound(first);
  if (prev != free_runs_.begin()) {
    --prev;
    if (prev->first + prev->second == first) {
      first = prev->first;
      n += prev->second;
      free_runs_.erase(prev);
    }
  }
  if (first + n == top_) {
    top_ = first;
    // The run now ending at the top (if any) goes with it.
    auto last = free_runs_.empty() ? free_runs_.end() : std::prev(free_runs_.end());
    if (last != free_runs_.end() && last->first + last->second == top_) {
      top_ = last->first;
      free_runs_.erase(last);
    }
    return;
  }
  free_runs_.emplace(first, n);
}

char* CacheArena::Allocate(size_t size) {
  if (size > kMaxSmall) {
    const uint32_t n = static_cast<uint32_t>((size + kSpan - 1) / kSpan);
    uint32_t first = 0;
    if (!TakeSpans(n, &first)) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    }
    SetWord(first, (kRunHead << kTypeShift) | n);
    char* p = SpanBase(first);
    // Faulted in by one call, not a fault a page (the read that fills it writes every byte).
    ::madvise(p, PageRound(size), MADV_POPULATE_WRITE);
    return p;
  }
  return AllocateIn(kData, ClassOf(size));
}

char* CacheArena::AllocateIn(Kind kind, uint32_t cls) {
  Class& c = classes_[kind][cls];
  MutexLock l(c.mu);
  if (c.partial.empty()) {
    uint32_t s = 0;
    if (!TakeSpans(1, &s)) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    }
    auto sp = std::make_unique<SmallSpan>();
    sp->free.assign((c.per_span + 63) / 64, 0);
    sp->partial_pos = 0;
    small_[s] = std::move(sp);
    SetWord(s, ((kind == kData ? kDataSpan : kRecordSpan) << kTypeShift) | cls);
    c.partial.push_back(s);
  }
  const uint32_t s = c.partial.back();
  SmallSpan& sp = *small_[s];
  uint32_t idx = 0;
  if (sp.nfree > 0) {
    size_t w = 0;
    while (sp.free[w] == 0) ++w;
    const int bit = __builtin_ctzll(sp.free[w]);
    sp.free[w] &= ~(uint64_t{1} << bit);
    idx = static_cast<uint32_t>(w * 64 + bit);
    sp.nfree--;
  } else {
    idx = sp.bump++;
  }
  sp.used++;
  if (sp.nfree == 0 && sp.bump == c.per_span) {
    c.partial.pop_back();
    sp.partial_pos = -1;
  }
  return SpanBase(s) + uint64_t{idx} * c.size;
}

void CacheArena::Free(char* p) {
  const uint32_t span = static_cast<uint32_t>((p - base_ - first_) / kSpan);
  const uint32_t word = Word(span);
  if ((word >> kTypeShift) == kRunHead) {
    const uint32_t n = word & kLowMask;
    SetWord(span, 0);
    Punch(p, uint64_t{n} * kSpan);
    GiveSpans(span, n);
    return;
  }
  FreeIn(span, word, p);
}

void CacheArena::FreeIn(uint32_t span, uint32_t word, char* p) {
  Class& c = classes_[(word >> kTypeShift) == kDataSpan ? kData : kRecord][word & kLowMask];
  {
    MutexLock l(c.mu);
    SmallSpan& sp = *small_[span];
    const uint64_t idx = static_cast<uint64_t>(p - SpanBase(span)) / c.size;
    sp.free[idx / 64] |= uint64_t{1} << (idx % 64);
    sp.nfree++;
    sp.used--;
    if (sp.used > 0) {
      if (sp.partial_pos < 0) {
        sp.partial_pos = static_cast<int32_t>(c.partial.size());
        c.partial.push_back(span);
      }
      return;
    }
    if (sp.partial_pos >= 0) {  // swap-remove from the class's spans with room
      const uint32_t moved = c.partial.back();
      c.partial[static_cast<size_t>(sp.partial_pos)] = moved;
      small_[moved]->partial_pos = sp.partial_pos;
      c.partial.pop_back();
    }
    small_[span].reset();
    SetWord(span, 0);
  }
  Punch(SpanBase(span), kSpan);
  GiveSpans(span, 1);
}

char* CacheArena::Shrink(char* p, size_t old_size, size_t new_size) {
  if (new_size >= old_size) return p;
  const uint32_t span = static_cast<uint32_t>((p - base_ - first_) / kSpan);
  const uint32_t word = Word(span);
  if ((word >> kTypeShift) == kRunHead && new_size > kMaxSmall) {
    const uint32_t n = word & kLowMask;
    const uint32_t keep = static_cast<uint32_t>((new_size + kSpan - 1) / kSpan);
    Punch(p + PageRound(new_size), uint64_t{n} * kSpan - PageRound(new_size));
    if (keep < n) {
      SetWord(span, (kRunHead << kTypeShift) | keep);
      GiveSpans(span + keep, n - keep);
    }
    return p;
  }
  if ((word >> kTypeShift) != kRunHead && (word & kLowMask) == ClassOf(new_size)) return p;
  char* q = Allocate(new_size);
  if (q == nullptr) return p;
  std::memcpy(q, p, new_size);
  Free(p);
  return q;
}

uint64_t CacheArena::Publish(std::string_view key, const char* data, size_t size) {
  if (key.size() > kMaxKey || !Owns(data) || size > UINT32_MAX) return 0;
  char* block = AllocateIn(kRecord, ClassOf(kRecordHeader + key.size()));
  if (block == nullptr) return 0;
  Record r{};
  r.key_len = static_cast<uint16_t>(key.size());
  r.size = static_cast<uint32_t>(size);
  r.data = static_cast<uint64_t>(data - base_);
  r.seq = seq_.fetch_add(1, std::memory_order_relaxed);
  r.crc = RecordCrc(r, key.data());
  std::memcpy(block, &r, sizeof r);
  std::memcpy(block + sizeof r, key.data(), key.size());
  // Whole before it is in force: a kill after the magic finds every byte above.
  std::atomic_ref<uint32_t>(reinterpret_cast<Record*>(block)->magic)
      .store(kLive, std::memory_order_release);
  return static_cast<uint64_t>(block - base_);
}

void CacheArena::Retire(uint64_t record) {
  if (record == 0) return;
  Withdraw(record);
  Free(base_ + record);
}

void CacheArena::Withdraw(uint64_t record) {
  if (record == 0) return;
  std::atomic_ref<uint32_t>(reinterpret_cast<Record*>(base_ + record)->magic)
      .store(0, std::memory_order_release);
}

std::string_view CacheArena::RecordKey(uint64_t record) const {
  const char* block = base_ + record;
  uint16_t len = 0;
  std::memcpy(&len, block + offsetof(Record, key_len), sizeof len);
  return {block + sizeof(Record), len};
}

Result<std::unique_ptr<CacheArena>> CacheArena::Adopt(int fd, Adoption* out) {
  struct stat st {};
  Header h{};
  if (::fstat(fd, &st) != 0 || ::pread(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h)) {
    const int err = errno;
    ::close(fd);
    return Status::FromErrno(err, "the cache memory of the process before cannot be read");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const bool form = h.magic == kMagic && h.layout == kLayout && h.span_bytes == kSpan &&
                    h.size == size && size % kSpan == 0 && size > MetaBytes(size) &&
                    h.nspans == (size - MetaBytes(size)) / kSpan &&
                    h.classes == ClassSizes().size() && h.class_sig == ClassSig();
  if (!form) {
    ::close(fd);
    return Status::InvalidArgument(
        "the cache memory of the process before is of another form (another build?)");
  }
  CTFS_ASSIGN_OR_RETURN(DurableRegion region, DurableRegion::Adopt(fd, size));
  std::unique_ptr<CacheArena> a(new CacheArena(std::move(region)));
  CTFS_RETURN_IF_ERROR(a->AdoptRecords(out));
  return a;
}

// Single-threaded: the arena is not shared yet.
Status CacheArena::AdoptRecords(Adoption* out) NO_THREAD_SAFETY_ANALYSIS {
  const std::vector<uint32_t>& sizes = ClassSizes();
  // The span table, checked: a word naming no class, or a run past the end or over a span
  // that is not clear, is taken for free (what it held is not adopted).
  std::vector<uint32_t> words(nspans_);
  for (uint32_t s = 0; s < nspans_; ++s) words[s] = Word(s);
  for (uint32_t s = 0; s < nspans_; ++s) {
    const uint32_t type = words[s] >> kTypeShift, low = words[s] & kLowMask;
    if ((type == kDataSpan || type == kRecordSpan) && low >= sizes.size()) words[s] = 0;
    if (type != kRunHead) continue;
    bool sound = low >= 1 && uint64_t{s} + low <= nspans_;
    for (uint32_t k = 1; sound && k < low; ++k) sound = words[s + k] == 0;
    if (!sound) {
      words[s] = 0;
      continue;
    }
    s += low - 1;
  }
  // Blocks claimed: a bit a block of each small span, a flag a run.
  std::vector<std::vector<uint64_t>> claims(nspans_);
  auto claim = [&](uint32_t s, uint64_t idx) {
    std::vector<uint64_t>& c = claims[s];
    if (c.empty()) {
      const bool run = (words[s] >> kTypeShift) == kRunHead;
      c.assign(run ? 1 : (kSpan / sizes[words[s] & kLowMask] + 63) / 64, 0);
    }
    uint64_t& w = c[idx / 64];
    const uint64_t bit = uint64_t{1} << (idx % 64);
    if (w & bit) return false;
    w |= bit;
    return true;
  };
  // Where a record's data block lies: its span and index, or false if not at a block's start
  // of a span of data of a class that holds its size.
  auto locate = [&](const Record& r, uint32_t* span, uint64_t* idx) {
    if (r.data < first_ || r.data >= region_.size()) return false;
    *span = static_cast<uint32_t>((r.data - first_) / kSpan);
    const uint64_t in = r.data - first_ - uint64_t{*span} * kSpan;
    const uint32_t w = words[*span];
    if ((w >> kTypeShift) == kRunHead) {
      *idx = 0;
      return in == 0 && r.size > kMaxSmall && r.size <= uint64_t{w & kLowMask} * kSpan;
    }
    if ((w >> kTypeShift) != kDataSpan) return false;
    const uint32_t cs = sizes[w & kLowMask];
    *idx = in / cs;
    return in % cs == 0 && *idx < kSpan / cs && r.size <= cs;
  };
  std::vector<char> scratch(kSpan);
  for (uint32_t s = 0; s < nspans_; ++s) {
    if ((words[s] >> kTypeShift) != kRecordSpan) continue;
    const uint32_t cs = sizes[words[s] & kLowMask];
    // Read through the descriptor: a hole reads as zeros there without being filled.
    const off_t at = static_cast<off_t>(SpanBase(s) - base_);
    if (::pread(region_.fd(), scratch.data(), kSpan, at) != static_cast<ssize_t>(kSpan))
      return Status::FromErrno(errno, "reading the cache records of the process before");
    for (uint64_t i = 0; i < kSpan / cs; ++i) {
      const char* slot = scratch.data() + i * cs;
      Record r;
      std::memcpy(&r, slot, sizeof r);
      if (r.magic == 0) continue;
      uint32_t ds = 0;
      uint64_t di = 0;
      const bool sound = r.magic == kLive && r.key_len <= kMaxKey &&
                         kRecordHeader + r.key_len <= cs && r.zero == 0 &&
                         RecordCrc(r, slot + sizeof r) == r.crc && locate(r, &ds, &di) &&
                         claim(ds, di);
      if (!sound) {  // cleared, so that no later adoption finds it
        std::atomic_ref<uint32_t>(reinterpret_cast<Record*>(SpanBase(s) + i * cs)->magic)
            .store(0, std::memory_order_relaxed);
        out->dropped++;
        continue;
      }
      claim(s, i);
      out->entries.push_back({std::string(slot + sizeof r, r.key_len), base_ + r.data,
                              static_cast<size_t>(r.size),
                              static_cast<uint64_t>(SpanBase(s) + i * cs - base_), r.seq});
      seq_.store(std::max(seq_.load(std::memory_order_relaxed), r.seq + 1),
                 std::memory_order_relaxed);
      out->bytes += r.size;
    }
  }
  std::sort(out->entries.begin(), out->entries.end(),
            [](const Entry& a, const Entry& b) { return a.seq > b.seq; });
  // The allocator's state, from what was claimed; every other span is free and holds no page.
  std::vector<uint8_t> in_use(nspans_, 0);
  uint32_t top = 0;
  for (uint32_t s = 0; s < nspans_; ++s) {
    const uint32_t type = words[s] >> kTypeShift, low = words[s] & kLowMask;
    if (type == kRunHead && !claims[s].empty()) {
      std::fill(in_use.begin() + s, in_use.begin() + s + low, 1);
      top = s + low;
      spans_used_.fetch_add(low, std::memory_order_relaxed);
      s += low - 1;
      continue;
    }
    if ((type != kDataSpan && type != kRecordSpan) || claims[s].empty()) {
      if (Word(s) != 0) SetWord(s, 0);
      continue;
    }
    Class& c = classes_[type == kDataSpan ? kData : kRecord][low];
    auto sp = std::make_unique<SmallSpan>();
    const std::vector<uint64_t>& claimed = claims[s];
    sp->free.assign((c.per_span + 63) / 64, 0);
    for (uint32_t i = 0; i < c.per_span; ++i)
      if (claimed[i / 64] & (uint64_t{1} << (i % 64))) {
        sp->used++;
        sp->bump = i + 1;
      }
    for (uint32_t i = 0; i < sp->bump; ++i)  // below the highest claimed: the rest is free
      if (!(claimed[i / 64] & (uint64_t{1} << (i % 64))))
        sp->free[i / 64] |= uint64_t{1} << (i % 64);
    sp->nfree = sp->bump - sp->used;
    if (sp->nfree > 0 || sp->bump < c.per_span) {
      sp->partial_pos = static_cast<int32_t>(c.partial.size());
      c.partial.push_back(s);
    }
    small_[s] = std::move(sp);
    in_use[s] = 1;
    spans_used_.fetch_add(1, std::memory_order_relaxed);
    top = s + 1;
  }
  top_ = top;
  for (uint32_t s = 0; s < top;) {
    if (in_use[s]) {
      ++s;
      continue;
    }
    uint32_t e = s;
    while (e < top && !in_use[e]) ++e;
    free_runs_.emplace(s, e - s);
    s = e;
  }
  // Pages of spans now free (blocks no record kept, a span the dead process was giving back)
  // go back, found by the memfd's own map of what it holds.
  for (off_t off = static_cast<off_t>(first_); region_.fd() >= 0;) {
    const off_t data = ::lseek(region_.fd(), off, SEEK_DATA);
    if (data < 0) break;
    off_t hole = ::lseek(region_.fd(), data, SEEK_HOLE);
    if (hole < 0) hole = static_cast<off_t>(region_.size());
    for (uint64_t s = (static_cast<uint64_t>(data) - first_) / kSpan;
         s < nspans_ && SpanBase(static_cast<uint32_t>(s)) < base_ + hole; ++s)
      if (!in_use[s]) Punch(SpanBase(static_cast<uint32_t>(s)), kSpan);
    off = hole;
  }
  return Status::OK();
}

}  // namespace cubetorchfs::cache
