// A directory only the daemon's user may enter, for copies of files other users may not
// read (the NVMe tier, S3 staging).
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace cubetorchfs {

enum class CreateDir { kNo, kDir, kWithParents };

// Makes `dir` private: created 0700 as `create` says (kNo: a missing directory is fine and
// left missing); an existing one must be a real directory (never a symlink) owned by us or
// root, and a wider mode is narrowed to 0700 (logged). Every directory above it must be owned
// by root or us and not writable by others unless sticky, so that nobody can swap it for a
// link later. Errors start with `key` (the config key); `holds` says what it holds.
Status EnsurePrivateDir(const std::string& dir, std::string_view key, std::string_view holds,
                        CreateDir create);

}  // namespace cubetorchfs
