// Registered file lists: a publisher names its dataset's files once (POST /v1/lists, each path
// resolved and checked for the caller then), and from then on sends each epoch's order as
// positions in that list (POST /v1/streams/{id}/positions, four bytes a file) instead of
// paths: no JSON, no path resolution, no permission walk per published file.
//
// A list is held front- and back-coded: in blocks of kBlock entries, the first entry of a block
// whole and each next one as the lengths of the prefix and the suffix it shares with the entry
// before it and the bytes between (three varints, then the bytes), with a 4-byte offset a
// block. A dataset's paths come sorted (ImageFolder's classes and files) and share their
// extension, so an entry costs its distinct digits and a few bytes (file_lists_test.cc measures
// ImageNet-like and COCO-like lists; docs/memory.md has the figures). An entry is found by
// decoding at most kBlock entries from its block's start, never the list whole. An entry
// refused at registration is kept, empty, so that later entries keep their numbers.
// Lists belong to their creator. What they hold is bounded per user (count and bytes) and for
// all users (bytes), the bytes being the capacity actually allocated. The global bytes are
// shared as queued paths are: while k users hold lists (the one registering counted), each may
// hold at most a (k + 1)-th of them, so a user with none always finds a share. A user at its
// own limits or its share loses its least recently used list (a publisher killed before it
// could delete it left one); past them with none to lose a registration is refused (429). A list
// unused for `idle_s` is dropped. A publisher whose list went registers it again (410 Gone tells
// it).
//
// Rights: the directories of each path are checked when it is registered; the file itself is
// checked, as for published paths, by the prefetcher before its bytes are fetched (so a file
// whose mode changed since is refused then).
//
// Thread safety: all methods are thread-safe (one leaf mutex, never held across a request to
// the store).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/mapped_buffer.h"
#include "common/thread_annotations.h"

namespace cubetorchfs::prefetch {

class FileLists {
 public:
  struct Options {
    uint64_t max_lists_per_uid = 16;
    uint64_t max_bytes_per_uid = 128ull << 20;
    uint64_t max_bytes = 256ull << 20;  // all users
    double idle_s = 3600;               // a list neither appended to nor used expires
  };
  // kOver: Paths would pass its Bound.
  enum class Op { kOk, kNotFound, kForbidden, kFull, kRange, kOver };

  FileLists(const Options& options, Clock* clock);

  // A new, empty list of `uid`; "" when that user has max_lists_per_uid already.
  std::string Create(uid_t uid);
  // Appends `entries` (store paths; "" for one refused at registration) to list `id` of
  // `uid` (root may act on any). kFull (nothing appended, *why names the limit) when the list
  // would take its owner or all users past their bytes. *first: the number of the first entry
  // appended; *size: the list's entries after.
  Op Append(uid_t uid, const std::string& id, const std::vector<std::string>& entries,
            uint64_t* first, uint64_t* size, std::string* why);
  Op Delete(uid_t uid, const std::string& id);
  // What Paths may decode: at most `paths` paths, together costing at most `bytes`, `cost`
  // giving what one path of n bytes costs (null: its length). A publish of positions is
  // bounded so before any path is decoded past what it could ever queue.
  struct Bound {
    uint64_t paths = UINT64_MAX;
    uint64_t bytes = UINT64_MAX;
    uint64_t (*cost)(size_t path_bytes) = nullptr;
  };
  // What Paths had decoded when it passed its Bound: the paths (refused entries left out)
  // and their cost, the one that passed it included; `counted`: true when the positions alone
  // passed `paths` (a list with no refused entry: nothing was decoded).
  struct Over {
    uint64_t paths = 0, bytes = 0;
    bool counted = false;
  };
  // The paths at `positions` of list `id`, in order, appended to *out; entries refused at
  // registration are left out and counted in *refused. kRange (nothing appended) if a
  // position is past the list's end; *size then says its entries. kOver (*out left as it
  // was, nothing more decoded) as soon as the paths would pass `bound`; *over, if given, says
  // how far it got.
  Op Paths(uid_t uid, const std::string& id, std::span<const uint32_t> positions,
           std::vector<std::string>* out, uint64_t* refused, uint64_t* size, const Bound& bound,
           Over* over = nullptr);
  Op Paths(uid_t uid, const std::string& id, std::span<const uint32_t> positions,
           std::vector<std::string>* out, uint64_t* refused, uint64_t* size) {
    return Paths(uid, id, positions, out, refused, size, Bound());
  }

  struct Stats {
    uint64_t lists = 0, entries = 0, bytes = 0;
  };
  Stats GetStats(std::optional<uid_t> only = std::nullopt);
  const Options& options() const { return options_; }
  // Drops lists idle for idle_s (done at most once a second by the other calls).
  void Sweep();

  // The largest list: positions are 32-bit.
  static constexpr uint64_t kMaxEntries = UINT32_MAX;

 private:
  static constexpr uint64_t kBlock = 16;  // entries a block; block b holds entries 16b..16b+15
  struct List {
    uid_t uid = 0;
    // The entries, front-coded (above), and where block b starts in them (a uint32_t each):
    // grown in place by the kernel (common/mapped_buffer.h), so a list of 180 M paths (3 GB)
    // is never held twice while it grows.
    MappedBuffer bytes;
    MappedBuffer blocks;
    uint64_t entries = 0;
    uint64_t refused = 0;  // entries refused at registration (kept empty)
    std::string last;      // the last entry appended: the next one is coded against it
    uint64_t charged = 0;  // the capacity of all three, as counted against the limits
    uint64_t last_used_ns = 0;
  };
  static uint64_t Charge(const List& l) {
    return l.bytes.capacity() + l.blocks.capacity() + l.last.capacity();
  }
  // Appends the coding of `entries` after those of `list` (whose last entry is *last, updated)
  // to *out; the number of blocks they start is added to *new_blocks. Pure: nothing of `list`
  // changes.
  static void Encode(uint64_t entries_before, std::string* last,
                     const std::vector<std::string>& entries, std::string* out,
                     uint64_t* new_blocks);
  // Entry `p` of `list` into *out; *before is scratch (kept across calls, so that resolving
  // many positions allocates nothing once both have grown). REQUIRES: p < list.entries.
  static void Decode(const List& list, uint64_t p, std::string* out, std::string* before);
  // List `id` if `uid` may use it (after dropping idle lists); else null and *op says why.
  List* FindLocked(uid_t uid, const std::string& id, uint64_t now, Op* op) REQUIRES(mu_);
  void EraseLocked(std::map<std::string, List>::iterator it) REQUIRES(mu_);
  void SweepLocked(uint64_t now) REQUIRES(mu_);
  // The users whose lists hold bytes, `uid` counted whether or not its do: the k of the fair
  // share of max_bytes (a (k + 1)-th each).
  uint64_t UsersLocked(uid_t uid) const REQUIRES(mu_);
  // Drops the least recently used list of `uid` other than `keep`; false if it has none.
  bool EvictOneLocked(uid_t uid, const std::string& keep) REQUIRES(mu_);

  const Options options_;
  Clock* const clock_;
  Mutex mu_;
  std::map<std::string, List> lists_ GUARDED_BY(mu_);
  struct Use {
    uint64_t lists = 0, bytes = 0;
  };
  std::unordered_map<uid_t, Use> use_ GUARDED_BY(mu_);
  uint64_t bytes_ GUARDED_BY(mu_) = 0;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  uint64_t last_sweep_ns_ GUARDED_BY(mu_) = 0;
};

}  // namespace cubetorchfs::prefetch
