// Reading a file another process left for us (the daemon's control file), trusting it only if
// no other user could have planted or changed it.
#pragma once

#include <sys/types.h>

#include <string>

#include "common/status.h"

namespace cubetorchfs {

// "uid 1000 (alice)", or "uid 1000" when the user has no name.
std::string OwnerName(uid_t uid);

// Root, or this process's real or effective user.
bool TrustedOwner(uid_t uid);

// The text of the control file at `path` (at most 1 MiB) if a reader may trust it: not a
// symlink (opened with O_NOFOLLOW), a regular file with one link, owned by a TrustedOwner,
// not group/world-writable. NotFound if absent; PermissionDenied naming the path and its
// owner otherwise; Corruption if larger.
Result<std::string> ReadTrustedControlFile(const std::string& path);

}  // namespace cubetorchfs
