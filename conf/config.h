// Loading and validating a cubetorchfs config (JSON or YAML; yaml-cpp reads both).
//
// Every error names the key path ("cache.memory_bytes") and why it is wrong. Unknown keys
// inside our sections are errors; unknown top-level keys are collected for a warning, since
// CubeFS client configs carry many keys of their own. Thread-safe (no shared state).
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "conf/options.h"

namespace cubetorchfs::conf {

// Parses "4194304", "4MiB", "1.5 GiB", "512KiB", "2TiB" (also KB/MB/GB/TB as binary units
// and K/M/G/T) into bytes. Rejects negatives, fractions of a byte and overflow.
Result<uint64_t> ParseSize(std::string_view text);

// Parses config text. `source` names it in error messages (usually the file path).
Result<Config> ParseConfig(const std::string& text, const std::string& source = "config");

// Reads and parses the file at `path`.
Result<Config> LoadConfig(const std::string& path);

}  // namespace cubetorchfs::conf
