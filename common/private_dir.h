// A directory only the daemon's user may enter, for copies of files other users may not
// read (the NVMe tier, S3 staging).
#pragma once

#include <sys/types.h>

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

// A directory the daemon writes its own files in that others may read or reach (the log
// directory, the control socket's): created with `create_mode` as `create` says; it must be
// a real directory owned by us or root and closed to others' writes unless sticky, and every
// directory above it likewise. Its mode is left as it is (it may be /var/log).
Status EnsureDaemonDir(const std::string& dir, std::string_view key, std::string_view holds,
                       CreateDir create, mode_t create_mode);

// Both refuse a path with a symlink in any component (`/tmp/x/log` where /tmp/x is a link):
// whoever owns a link can point it elsewhere later. The error names the link and its target.
// The first such component of `path` (made absolute), or "" if none; components that do not
// exist end the walk.
std::string SymlinkInPath(const std::string& path);

}  // namespace cubetorchfs
