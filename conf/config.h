// Loading and validating a cubetorchfs config (JSON or YAML; yaml-cpp reads both).
//
// Every error names the key path ("cache.memory_bytes") and why it is wrong, on one line (control
// characters escaped, at most 1 KiB): the daemon prints it and exits 2. No exception leaves
// ParseConfig or LoadConfig. Unknown keys inside our sections are errors; unknown top-level keys
// are collected for a warning, since CubeFS client configs carry many keys of their own.
// Thread-safe (no shared state).
//
// Hardening (the daemon runs as root and the config names paths and mount options):
//   - the file must be a regular file (stat before open, then fstat of what was opened, which
//     is opened O_NONBLOCK: a FIFO or a device is refused and never blocks) of at most
//     kMaxConfigBytes;
//   - a key given twice in one map, at any level, is an error (yaml-cpp keeps the last one
//     silently); so are non-string keys, keys with control characters and a second document;
//   - volName is 1 to kMaxVolNameBytes of [A-Za-z0-9._-] (it goes into the mount option
//     fsname=cubetorchfs:<volName>, the control file name and the control socket path);
//   - no string value may hold a control character (NUL, newline, ...);
//   - the control socket path (ControlSocketPath) must fit sockaddr_un.sun_path;
//   - cache.memory_bytes above physical memory is a warning (Config::warnings), not an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "conf/options.h"

namespace cubetorchfs::conf {

// Largest config file read.
inline constexpr size_t kMaxConfigBytes = 1u << 20;
// Longest volName.
inline constexpr size_t kMaxVolNameBytes = 64;

// Parses "4194304", "4MiB", "1.5 GiB", "512KiB", "2TiB" (also KB/MB/GB/TB as binary units
// and K/M/G/T) into bytes. Rejects negatives, fractions of a byte and overflow.
Result<uint64_t> ParseSize(std::string_view text);

// The backend.type named `name` ("posix", "s3", "cubefs", "synthetic"); an unknown one is an
// error naming the key backend.type and the known types.
Result<BackendType> ParseBackendType(const std::string& name);
// The config's name of `type` ("posix", ...).
const char* BackendTypeName(BackendType type);

// Parses config text. `source` names it in error messages (usually the file path).
Result<Config> ParseConfig(const std::string& text, const std::string& source = "config");

// Reads and parses the file at `path`; logs Config::warnings (to stderr, before the daemon
// opens its log file).
Result<Config> LoadConfig(const std::string& path);

// The control API's unix socket: prefetch.control_socket, or /run/cubetorchfs/<volName>.sock.
std::string ControlSocketPath(const Config& config);

// sysconf(_SC_PHYS_PAGES) * page size; 0 if unknown.
uint64_t PhysicalMemoryBytes();

}  // namespace cubetorchfs::conf
