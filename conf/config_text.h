// Internal to conf/: the config's text before it is parsed into a Config. Reading the file
// (a regular file, bounded in size), the checks yaml-cpp does not make (duplicate keys, keys
// that are not strings or hold control characters, a second document), and the CubeFS
// client's keys a config may carry.
#pragma once

#include <string>

#include "common/status.h"

namespace cubetorchfs::conf {

// Whether `s` holds a control character (below 0x20, or DEL).
bool HasControlChar(const std::string& s);

// The text of the config file at `path`: refused unless a regular file of at most
// kMaxConfigBytes; never blocks on a FIFO or opens a device.
Result<std::string> ReadConfigFile(const std::string& path);

// Walks the parser's events of `text` and refuses what yaml-cpp would accept silently.
Status CheckKeys(const std::string& text);

// Whether `key` is one of the CubeFS client's config.json keys, accepted at the top level
// without a warning (most have no meaning here).
bool IsCubeFsClientKey(const std::string& key);

}  // namespace cubetorchfs::conf
