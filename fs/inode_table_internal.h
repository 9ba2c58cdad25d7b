// Internal to fs/inode_table*.cc: what the table's three files share: the layout of its durable
// region (its header, its magic and record form), the masks of an inode number, and two small
// hashes. See inode_table.h for the table itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>
#include <utility>

#include "fs/inode_table.h"

namespace cubetorchfs::fs {
namespace inode_table_internal {

constexpr uint32_t kSlotMask = InodeTable::kSlotBits == 28 ? 0x0FFFFFFFu : 0;
constexpr uint64_t kReuseMask = (uint64_t{1} << InodeTable::kReuseBits) - 1;

inline uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

inline uint64_t VersionDigest(const cfs_client::FileVersion& v) {
  const uint64_t h = Mix(v.size ^ Mix(static_cast<uint64_t>(v.mtime_ns) ^
                                      Mix(v.id ^ Mix(static_cast<uint64_t>(v.ctime_ns)))));
  return h == 0 ? 1 : h;
}

// "a/b/c" -> ("a/b", "c"); "c" -> ("", "c").
inline std::pair<std::string_view, std::string_view> SplitLast(std::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), path};
  return {path.substr(0, slash), path.substr(slash + 1)};
}

inline constexpr uint64_t kRegionMagic = 0x31524E49'53465443ull;  // "CTFSINR1"
inline constexpr unsigned char kHeapName = 0xFF;
// What must match for a process to read another's records: their size, the chunk and name
// geometry and the version of this code's record form.
inline constexpr uint64_t kRecordForm = 1;

}  // namespace inode_table_internal

// What the region begins with. `layout` tells a table of another build's records apart.
struct InodeTable::DurableHeader {
  uint64_t magic;
  uint64_t layout;
  std::atomic<uint64_t> slots;           // slots_: records at and past it were never used
  std::atomic<uint64_t> dev_count;       // dev_count_
  std::atomic<uint64_t> devs[kMaxDevs];  // devs_
};

}  // namespace cubetorchfs::fs
