// The operator's subcommands:
//   cubetorchfs status MOUNTPOINT [--json]       health of a mount; exit 0 healthy, 1 not
//   cubetorchfs upgrade MOUNTPOINT [--timeout S] hand the mount to the installed binary
// Both find the daemon through /proc/self/mountinfo (fsname cubetorchfs:<volName>) and the
// volume's control file, never by touching the mount itself (a hung mount must not hang them).
#pragma once

#include <string>
#include <vector>

namespace cubetorchfs::daemon {

int RunStatus(const std::vector<std::string>& args);
int RunUpgrade(const std::vector<std::string>& args);

// /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
std::string UnescapeMountinfo(const std::string& s);

}  // namespace cubetorchfs::daemon
