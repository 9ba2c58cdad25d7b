#include "conf/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/mark.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "conf/config_text.h"

namespace cubetorchfs::conf {
namespace {

// Our own top-level keys.
const std::set<std::string> kTopLevelKeys = {
    "volName", "mountPoint", "logDir", "logLevel", "exporterPort", "profPort",
    "profile", "backend",    "cache",  "prefetch", "control",      "fuse",
};

// Longest unix socket path: sockaddr_un.sun_path with its terminating NUL.
constexpr size_t kMaxSocketPathBytes = sizeof(sockaddr_un{}.sun_path) - 1;
// Longest error message: a config value quoted in one cannot flood the terminal.
constexpr size_t kMaxErrorBytes = 1024;

Status Bad(const std::string& key, const std::string& why) {
  return Status::InvalidArgument(key + ": " + why);
}

// A config value for an error message: quoted, at most 80 bytes (cut before a whole UTF-8
// sequence). Not escaped here: every config error is escaped once, by OneLine.
std::string Quote(const std::string& s) {
  size_t n = std::min<size_t>(s.size(), 80);
  while (n > 0 && n < s.size() && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) --n;
  std::string q = "\"";
  q.append(s, 0, n);
  q += n < s.size() ? "...\"" : "\"";
  return q;
}

// Every config error is one line of bounded length, whatever the file holds.
Status OneLine(const Status& s) {
  return Status::InvalidArgument(EscapeLogText(s.message(), kMaxErrorBytes));
}

std::string Scalar(const YAML::Node& n) { return n.IsScalar() ? n.Scalar() : std::string(); }

// Strings end up in paths, mount options, HTTP headers and log lines: none may hold a control
// character (NUL, newline, tab, ESC, ...).
Result<std::string> GetString(const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) return Bad(key, "must be a string");
  if (HasControlChar(n.Scalar()))
    return Bad(key, "must not contain control characters (NUL, newline, tab, ...), got " +
                        Quote(n.Scalar()));
  return n.Scalar();
}

Result<uint64_t> GetUint(const YAML::Node& n, const std::string& key, uint64_t max) {
  if (!n.IsScalar()) return Bad(key, "must be a non-negative integer");
  const std::string& s = n.Scalar();
  if (!s.empty() && s[0] == '-') return Bad(key, "must not be negative, got " + s);
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos)
    return Bad(key, "must be a non-negative integer, got \"" + s + "\"");
  errno = 0;
  unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
  if (errno == ERANGE || v > max) return Bad(key, "must be at most " + std::to_string(max));
  return static_cast<uint64_t>(v);
}

Result<double> GetDouble(const YAML::Node& n, const std::string& key, double lo, double hi) {
  if (!n.IsScalar()) return Bad(key, "must be a number");
  const std::string& s = n.Scalar();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
    return Bad(key, "must be a number, got \"" + s + "\"");
  if (v < lo || v > hi) {
    std::ostringstream os;
    os << "must be between " << lo << " and " << hi << ", got " << s;
    return Bad(key, os.str());
  }
  return v;
}

Result<bool> GetBool(const YAML::Node& n, const std::string& key) {
  std::string s = Scalar(n);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "true" || s == "yes" || s == "on" || s == "1") return true;
  if (s == "false" || s == "no" || s == "off" || s == "0") return false;
  return Bad(key, "must be true or false");
}

Result<uint64_t> GetSize(const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) return Bad(key, "must be a size (bytes, or a string like \"4GiB\")");
  Result<uint64_t> r = ParseSize(n.Scalar());
  if (!r.ok()) return Bad(key, r.status().message());
  return r;
}

// Assigns a parsed value or returns the error from the enclosing function.
#define CTFS_ASSIGN(lhs, expr)        \
  do {                                \
    auto _r = (expr);                 \
    if (!_r.ok()) return _r.status(); \
    lhs = std::move(_r.value());      \
  } while (0)

// Visits each key of map section `node` (named `prefix`); unknown keys are errors.
template <typename Fn>
Status ForEachKey(const YAML::Node& node, const std::string& prefix,
                  const std::set<std::string>& known, Fn&& fn) {
  if (!node.IsMap()) return Bad(prefix, "must be an object");
  for (const auto& kv : node) {
    std::string k = Scalar(kv.first);
    if (!known.count(k)) {
      std::string list;
      for (const auto& name : known) list += (list.empty() ? "" : ", ") + name;
      return Bad(prefix + "." + k, "unknown key (known: " + list + ")");
    }
    CTFS_RETURN_IF_ERROR(fn(k, kv.second, prefix + "." + k));
  }
  return Status::OK();
}

Status ParseInject(const YAML::Node& node, InjectOptions* o) {
  o->enabled = true;
  return ForEachKey(node, "backend.inject",
                    {"latency_us", "error_rate", "seed", "max_concurrency", "bandwidth_bytes_s"},
                    [&](const std::string& k, const YAML::Node& v, const std::string& key) {
                      if (k == "latency_us")
                        CTFS_ASSIGN(o->latency_us, GetUint(v, key, 60'000'000));
                      if (k == "error_rate") CTFS_ASSIGN(o->error_rate, GetDouble(v, key, 0, 1));
                      if (k == "seed") CTFS_ASSIGN(o->seed, GetUint(v, key, UINT64_MAX));
                      if (k == "max_concurrency")
                        CTFS_ASSIGN(o->max_concurrency, GetUint(v, key, 1'000'000));
                      if (k == "bandwidth_bytes_s") {
                        // Bytes per second, as a size ("1GiB" is 2^30 bytes a second).
                        CTFS_ASSIGN(o->bandwidth_bytes_s, GetSize(v, key));
                        if (o->bandwidth_bytes_s > (uint64_t{1} << 50))
                          return Bad(key, "must be at most 1PiB a second, got " + Scalar(v));
                      }
                      return Status::OK();
                    });
}

Status ParseSynthetic(const YAML::Node& node, SyntheticOptions* o) {
  return ForEachKey(node, "backend.synthetic",
                    {"dirs", "files_per_dir", "min_bytes", "max_bytes", "seed"},
                    [&](const std::string& k, const YAML::Node& v, const std::string& key) {
                      if (k == "dirs") CTFS_ASSIGN(o->dirs, GetUint(v, key, 100'000'000));
                      if (k == "files_per_dir")
                        CTFS_ASSIGN(o->files_per_dir, GetUint(v, key, 100'000'000));
                      if (k == "min_bytes") CTFS_ASSIGN(o->min_bytes, GetSize(v, key));
                      if (k == "max_bytes") CTFS_ASSIGN(o->max_bytes, GetSize(v, key));
                      if (k == "seed") CTFS_ASSIGN(o->seed, GetUint(v, key, UINT64_MAX));
                      return Status::OK();
                    });
}

Status ParseCubefs(const YAML::Node& node, CubefsOptions* o) {
  return ForEachKey(node, "backend.cubefs", {"lib", "volume", "remote_cache"},
                    [&](const std::string& k, const YAML::Node& v, const std::string& key) {
                      if (k == "lib") CTFS_ASSIGN(o->lib, GetString(v, key));
                      if (k == "volume") CTFS_ASSIGN(o->volume, GetString(v, key));
                      if (k == "remote_cache") CTFS_ASSIGN(o->remote_cache, GetBool(v, key));
                      return Status::OK();
                    });
}

// Keys of the s3 backend; set_s3_keys collects those present (an error with type posix).
const std::set<std::string> kS3Keys = {
    "endpoint",    "bucket",          "region",           "prefix",  "path_style",
    "access_key",  "secret_key",      "timeout_ms",       "retries", "max_connections",
    "staging_dir", "multipart_bytes", "lookup_read_bytes"};

Status ParseBackend(const YAML::Node& node, BackendOptions* o, std::vector<std::string>* s3_set) {
  std::set<std::string> known = {"type", "root", "inject", "cubefs", "synthetic"};
  known.insert(kS3Keys.begin(), kS3Keys.end());
  S3Options* s3 = &o->s3;
  return ForEachKey(node, "backend", known,
                    [&](const std::string& k, const YAML::Node& v, const std::string& key) {
                      if (kS3Keys.count(k)) s3_set->push_back(k);
                      if (k == "type") {
                        CTFS_ASSIGN_OR_RETURN(std::string name, GetString(v, key));
                        CTFS_ASSIGN(o->type, ParseBackendType(name));
                      }
                      if (k == "root") CTFS_ASSIGN(o->root, GetString(v, key));
                      if (k == "inject") return ParseInject(v, &o->inject);
                      if (k == "cubefs") return ParseCubefs(v, &o->cubefs);
                      if (k == "synthetic") return ParseSynthetic(v, &o->synthetic);
                      if (k == "endpoint") CTFS_ASSIGN(s3->endpoint, GetString(v, key));
                      if (k == "bucket") CTFS_ASSIGN(s3->bucket, GetString(v, key));
                      if (k == "region") CTFS_ASSIGN(s3->region, GetString(v, key));
                      if (k == "prefix") CTFS_ASSIGN(s3->prefix, GetString(v, key));
                      if (k == "path_style") CTFS_ASSIGN(s3->path_style, GetBool(v, key));
                      if (k == "access_key") CTFS_ASSIGN(s3->access_key, GetString(v, key));
                      if (k == "secret_key") CTFS_ASSIGN(s3->secret_key, GetString(v, key));
                      if (k == "timeout_ms") {
                        CTFS_ASSIGN(s3->timeout_ms, GetUint(v, key, 3'600'000));
                        if (s3->timeout_ms == 0) return Bad(key, "must be at least 1");
                      }
                      if (k == "retries") {
                        uint64_t n = 0;
                        CTFS_ASSIGN(n, GetUint(v, key, 20));
                        s3->retries = static_cast<uint32_t>(n);
                      }
                      if (k == "staging_dir") CTFS_ASSIGN(s3->staging_dir, GetString(v, key));
                      if (k == "multipart_bytes") {
                        CTFS_ASSIGN(s3->multipart_bytes, GetSize(v, key));
                        if (s3->multipart_bytes < (5u << 20))
                          return Bad(key, "must be at least 5MiB (S3's smallest part)");
                      }
                      if (k == "lookup_read_bytes") {
                        CTFS_ASSIGN(s3->lookup_read_bytes, GetSize(v, key));
                        if (s3->lookup_read_bytes > (64u << 20))
                          return Bad(key, "must be at most 64MiB");
                      }
                      if (k == "max_connections") {
                        uint64_t n = 0;
                        CTFS_ASSIGN(n, GetUint(v, key, 4096));
                        if (n == 0) return Bad(key, "must be at least 1");
                        s3->max_connections = static_cast<uint32_t>(n);
                      }
                      return Status::OK();
                    });
}

bool HasAny(const std::string& s, const char* chars) {
  return s.find_first_of(chars) != std::string::npos;
}

// The s3 backend's keys, once the defaults are filled in.
Status ValidateS3(const S3Options& s3) {
  const std::string& e = s3.endpoint;
  if (e.empty())
    return Bad("backend.endpoint", "required for the s3 backend (e.g. \"http://127.0.0.1:9000\")");
  const size_t scheme = e.rfind("http://", 0) == 0 ? 7 : e.rfind("https://", 0) == 0 ? 8 : 0;
  if (scheme == 0)
    return Bad("backend.endpoint", "must start with http:// or https://, got \"" + e + "\"");
  if (e.size() == scheme || e[scheme] == '/' || e[scheme] == ':')
    return Bad("backend.endpoint", "names no host: \"" + e + "\"");
  if (HasAny(e, " \t\r\n?#@"))
    return Bad(
        "backend.endpoint",
        "must be scheme://host[:port][/path], without spaces, '?', '#' or '@': \"" + e + "\"");
  if (s3.bucket.empty()) return Bad("backend.bucket", "must not be empty");
  if (HasAny(s3.bucket, "/ \t\r\n?#\\"))
    return Bad("backend.bucket", "not a bucket name: \"" + s3.bucket + "\"");
  if (s3.region.empty() || HasAny(s3.region, ": \t\r\n/"))
    return Bad("backend.region", "not a region name: \"" + s3.region + "\"");
  if (!s3.prefix.empty() && s3.prefix[0] == '/')
    return Bad("backend.prefix", "must not start with '/' (keys have no leading slash)");
  if (s3.access_key.empty() != s3.secret_key.empty())
    return Bad(s3.access_key.empty() ? "backend.access_key" : "backend.secret_key",
               "required with " + std::string(s3.access_key.empty() ? "backend.secret_key"
                                                                    : "backend.access_key"));
  return Status::OK();
}

Status ParseCache(const YAML::Node& node, CacheOptions* o) {
  return ForEachKey(
      node, "cache",
      {"memory_bytes", "disk_dir", "disk_bytes", "chunk_bytes", "stream_min_bytes", "durable"},
      [&](const std::string& k, const YAML::Node& v, const std::string& key) {
        if (k == "memory_bytes") CTFS_ASSIGN(o->memory_bytes, GetSize(v, key));
        if (k == "disk_dir") CTFS_ASSIGN(o->disk_dir, GetString(v, key));
        if (k == "disk_bytes") CTFS_ASSIGN(o->disk_bytes, GetSize(v, key));
        if (k == "chunk_bytes") CTFS_ASSIGN(o->chunk_bytes, GetSize(v, key));
        if (k == "stream_min_bytes") CTFS_ASSIGN(o->stream_min_bytes, GetSize(v, key));
        if (k == "durable") CTFS_ASSIGN(o->durable, GetBool(v, key));
        return Status::OK();
      });
}

Status ParsePrefetch(const YAML::Node& node, PrefetchOptions* o) {
  return ForEachKey(
      node, "prefetch",
      {"enabled", "max_inflight", "window_files", "window_bytes", "evict_after_read",
       "trust_page_cache", "restore_pages", "control_socket", "max_streams_per_uid",
       "max_queued_paths_per_uid", "max_queued_paths", "max_queued_path_bytes_per_uid",
       "max_queued_path_bytes", "max_lists_per_uid", "max_list_bytes_per_uid", "max_list_bytes"},
      [&](const std::string& k, const YAML::Node& v, const std::string& key) {
        if (k == "enabled") CTFS_ASSIGN(o->enabled, GetBool(v, key));
        if (k == "max_inflight") {
          uint64_t n = 0;
          CTFS_ASSIGN(n, GetUint(v, key, 4096));
          if (n == 0) return Bad(key, "must be at least 1");
          o->max_inflight = static_cast<uint32_t>(n);
        }
        if (k == "window_files") CTFS_ASSIGN(o->window_files, GetUint(v, key, UINT64_MAX));
        if (k == "window_bytes") CTFS_ASSIGN(o->window_bytes, GetSize(v, key));
        if (k == "evict_after_read") CTFS_ASSIGN(o->evict_after_read, GetBool(v, key));
        if (k == "trust_page_cache") CTFS_ASSIGN(o->trust_page_cache, GetBool(v, key));
        if (k == "restore_pages") {
          using R = PrefetchOptions::RestorePages;
          if (v.IsScalar() && v.Scalar() == "auto") {
            o->restore_pages = R::kAuto;
          } else {
            bool on = false;
            if (!v.IsScalar() || !(v.Scalar() == "true" || v.Scalar() == "false"))
              return Bad(key, "must be auto, true or false");
            CTFS_ASSIGN(on, GetBool(v, key));
            o->restore_pages = on ? R::kAlways : R::kNever;
          }
        }
        if (k == "control_socket") CTFS_ASSIGN(o->control_socket, GetString(v, key));
        uint64_t* limit = k == "max_streams_per_uid"        ? &o->max_streams_per_uid
                          : k == "max_queued_paths_per_uid" ? &o->max_queued_paths_per_uid
                          : k == "max_queued_paths"         ? &o->max_queued_paths
                          : k == "max_lists_per_uid"        ? &o->max_lists_per_uid
                                                            : nullptr;
        if (limit != nullptr) {
          CTFS_ASSIGN(*limit, GetUint(v, key, 1ull << 26));
          if (*limit == 0) return Bad(key, "must be at least 1");
        }
        // Memory an outsider's published paths may make the daemon hold: room for a few
        // paths of the longest kind (about 8 KiB each), at most 4 GiB.
        uint64_t* bytes = k == "max_queued_path_bytes_per_uid" ? &o->max_queued_path_bytes_per_uid
                          : k == "max_queued_path_bytes"       ? &o->max_queued_path_bytes
                                                               : nullptr;
        if (bytes != nullptr) {
          CTFS_ASSIGN(*bytes, GetSize(v, key));
          if (*bytes < (64u << 10))
            return Bad(key,
                       "must be at least 64KiB (a path of 4096 bytes queued holds about 8KiB)");
          if (*bytes > (4ull << 30)) return Bad(key, "must be at most 4GiB");
        }
        // A registered list's paths: at most 4 GiB (32-bit offsets), room for one long path.
        uint64_t* list = k == "max_list_bytes_per_uid" ? &o->max_list_bytes_per_uid
                         : k == "max_list_bytes"       ? &o->max_list_bytes
                                                       : nullptr;
        if (list != nullptr) {
          CTFS_ASSIGN(*list, GetSize(v, key));
          if (*list < (64u << 10)) return Bad(key, "must be at least 64KiB");
          if (*list > (4ull << 30)) return Bad(key, "must be at most 4GiB");
        }
        return Status::OK();
      });
}

Status ParseControl(const YAML::Node& node, ControlOptions* o) {
  CTFS_RETURN_IF_ERROR(ForEachKey(
      node, "control",
      {"max_body_bytes", "body_memory_bytes", "max_json_elements", "max_json_depth",
       "max_connections_unix", "max_connections_tcp", "max_connections_per_uid", "idle_timeout_s",
       "batch_max_bytes", "batch_memory_bytes_per_uid"},
      [&](const std::string& k, const YAML::Node& v, const std::string& key) -> Status {
        // A count or size in [min, max]; the bytes an outsider's requests may make the daemon
        // hold are capped at 4 GiB.
        auto get = [&](uint64_t* field, uint64_t min, uint64_t max, bool size) -> Status {
          Result<uint64_t> n = size ? GetSize(v, key) : GetUint(v, key, max);
          if (!n.ok()) return n.status();
          if (*n < min) return Bad(key, "must be at least " + std::to_string(min));
          if (*n > max) return Bad(key, "must be at most " + std::to_string(max));
          *field = *n;
          return Status::OK();
        };
        if (k == "max_body_bytes") return get(&o->max_body_bytes, 1, 4ull << 30, true);
        if (k == "body_memory_bytes") return get(&o->body_memory_bytes, 1, 4ull << 30, true);
        if (k == "max_json_elements") return get(&o->max_json_elements, 1, 1ull << 26, false);
        if (k == "max_json_depth") return get(&o->max_json_depth, 1, 1024, false);
        if (k == "max_connections_unix") return get(&o->max_connections_unix, 1, 65536, false);
        // 0 refuses every connection on 127.0.0.1:profPort.
        if (k == "max_connections_tcp") return get(&o->max_connections_tcp, 0, 65536, false);
        if (k == "max_connections_per_uid")
          return get(&o->max_connections_per_uid, 1, 65536, false);
        if (k == "idle_timeout_s") CTFS_ASSIGN(o->idle_timeout_s, GetDouble(v, key, 0.1, 3600));
        if (k == "batch_max_bytes") return get(&o->batch_max_bytes, 1 << 20, 1ull << 30, true);
        if (k == "batch_memory_bytes_per_uid")
          return get(&o->batch_memory_bytes_per_uid, 1 << 20, 64ull << 30, true);
        return Status::OK();
      }));
  if (o->body_memory_bytes < o->max_body_bytes)
    return Bad("control.body_memory_bytes", "must be at least control.max_body_bytes");
  if (o->batch_memory_bytes_per_uid < o->batch_max_bytes)
    return Bad("control.batch_memory_bytes_per_uid", "must be at least control.batch_max_bytes (" +
                                                         std::to_string(o->batch_max_bytes) +
                                                         " bytes): a whole batch must fit");
  return Status::OK();
}

// Which fuse.* timeouts the file set explicitly (so profile and CubeFS keys don't override).
struct FuseExplicit {
  bool entry = false, attr = false, negative = false, read_only = false, keep_cache = false,
       list_ahead = false;
};

Status ParseFuse(const YAML::Node& node, FuseOptions* o, FuseExplicit* set) {
  constexpr double kMaxTimeout = 86400.0 * 365;
  return ForEachKey(node, "fuse",
                    {"read_only", "entry_timeout_s", "attr_timeout_s", "negative_timeout_s",
                     "max_read", "read_ahead", "keep_cache", "flush_on_close", "write_back_idle_s",
                     "list_ahead", "list_ahead_threads", "dir_memory_bytes", "list_page_entries",
                     "max_writes_per_uid", "io_uring", "passthrough"},
                    [&](const std::string& k, const YAML::Node& v, const std::string& key) {
                      if (k == "read_only") {
                        CTFS_ASSIGN(o->read_only, GetBool(v, key));
                        set->read_only = true;
                      }
                      if (k == "entry_timeout_s") {
                        CTFS_ASSIGN(o->entry_timeout_s, GetDouble(v, key, 0, kMaxTimeout));
                        set->entry = true;
                      }
                      if (k == "attr_timeout_s") {
                        CTFS_ASSIGN(o->attr_timeout_s, GetDouble(v, key, 0, kMaxTimeout));
                        set->attr = true;
                      }
                      if (k == "negative_timeout_s") {
                        CTFS_ASSIGN(o->negative_timeout_s, GetDouble(v, key, 0, kMaxTimeout));
                        set->negative = true;
                      }
                      if (k == "max_read") {
                        CTFS_ASSIGN(o->max_read, GetSize(v, key));
                        if (o->max_read < 4096 || o->max_read > (1u << 20))
                          return Bad(key, "must be between 4KiB and 1MiB");
                      }
                      if (k == "read_ahead") {
                        CTFS_ASSIGN(o->read_ahead_bytes, GetSize(v, key));
                        if (o->read_ahead_bytes % 4096 != 0 || o->read_ahead_bytes > (64u << 20))
                          return Bad(key,
                                     "must be a multiple of 4KiB, at most 64MiB (0: the "
                                     "kernel's)");
                      }
                      if (k == "keep_cache") {
                        CTFS_ASSIGN(o->keep_cache, GetBool(v, key));
                        set->keep_cache = true;
                      }
                      if (k == "list_ahead") {
                        CTFS_ASSIGN(o->list_ahead, GetUint(v, key, 1024));
                        set->list_ahead = true;
                      }
                      if (k == "list_ahead_threads") {
                        uint64_t n = 0;
                        CTFS_ASSIGN(n, GetUint(v, key, 64));
                        if (n == 0) return Bad(key, "must be at least 1");
                        o->list_ahead_threads = static_cast<unsigned>(n);
                      }
                      if (k == "max_writes_per_uid") {
                        CTFS_ASSIGN(o->max_writes_per_uid, GetUint(v, key, 1u << 20));
                        if (o->max_writes_per_uid == 0) return Bad(key, "must be at least 1");
                      }
                      if (k == "list_page_entries") {
                        CTFS_ASSIGN(o->list_page_entries, GetUint(v, key, 1u << 20));
                        if (o->list_page_entries == 0) return Bad(key, "must be at least 1");
                      }
                      if (k == "dir_memory_bytes") {
                        CTFS_ASSIGN(o->dir_memory_bytes, GetSize(v, key));
                        if (o->dir_memory_bytes < (1u << 20))
                          return Bad(key, "must be at least 1MiB");
                      }
                      if (k == "io_uring" || k == "passthrough") {
                        const std::string m = v.IsScalar() ? v.Scalar() : "";
                        FuseOptions::Mode mode;
                        if (m == "auto")
                          mode = FuseOptions::Mode::kAuto;
                        else if (m == "on" || m == "true")
                          mode = FuseOptions::Mode::kOn;
                        else if (m == "off" || m == "false")
                          mode = FuseOptions::Mode::kOff;
                        else
                          return Bad(key, "must be auto, on or off, got " + Quote(m));
                        (k == "io_uring" ? o->io_uring : o->passthrough) = mode;
                      }
                      if (k == "flush_on_close") CTFS_ASSIGN(o->flush_on_close, GetBool(v, key));
                      if (k == "write_back_idle_s")
                        CTFS_ASSIGN(o->write_back_idle_s, GetDouble(v, key, 0.05, 3600));
                      return Status::OK();
                    });
}

// The cubefs backend's keys, once volName and logDir are filled in.
Status ValidateCubefs(const CubefsOptions& o) {
  if (o.master_addr.empty())
    return Bad("masterAddr",
               "required with backend.type cubefs (the CubeFS master, "
               "\"host:port[,host:port...]\")");
  std::stringstream addrs(o.master_addr);
  for (std::string addr; std::getline(addrs, addr, ',');) {
    const size_t colon = addr.rfind(':');
    const bool ok = colon != std::string::npos && colon > 0 && colon + 1 < addr.size() &&
                    addr.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
                    !HasAny(addr, " \t/\"'");
    if (!ok)
      return Bad("masterAddr", "want \"host:port[,host:port...]\", got " + Quote(o.master_addr));
  }
  if (o.volume.empty()) return Bad("backend.cubefs.volume", "must not be empty");
  if (o.access_key.empty() || o.secret_key.empty())
    return Bad(o.access_key.empty() ? "accessKey" : "secretKey",
               "required with backend.type cubefs (the volume owner's keys: cfs-cli user info)");
  return Status::OK();
}

// `s3_set`: the s3 backend's keys present in the file.
Status Validate(const Config& c, const std::vector<std::string>& s3_set) {
  if (c.vol_name.empty()) return Bad("volName", "required (the volume or bucket name)");
  // volName goes into the FUSE mount options (fsname=cubetorchfs:<volName>), the control file
  // name and the control socket path: only characters that mean nothing in any of them.
  const bool vol_chars_ok = std::all_of(c.vol_name.begin(), c.vol_name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-';
  });
  if (!vol_chars_ok || c.vol_name.size() > kMaxVolNameBytes)
    return Bad("volName", "must be 1 to " + std::to_string(kMaxVolNameBytes) +
                              " of the characters A-Z a-z 0-9 . _ - (it names the mount source, "
                              "the control file and the control socket), got " +
                              Quote(c.vol_name) + " (" + std::to_string(c.vol_name.size()) +
                              " bytes)");
  if (c.vol_name == "." || c.vol_name == "..") return Bad("volName", "must not be \".\" or \"..\"");
  // It names files an operator hands to commands (`ls <volName>.sock`): "-rf" would be options.
  if (c.vol_name.front() == '-')
    return Bad("volName",
               "must not start with '-' (it would read as an option to the commands "
               "given it), got " +
                   Quote(c.vol_name));
  if (const std::string sock = ControlSocketPath(c); sock.size() > kMaxSocketPathBytes)
    return Bad("prefetch.control_socket",
               (c.prefetch.control_socket.empty() ? "the default path " : "") + Quote(sock) +
                   " is " + std::to_string(sock.size()) + " bytes; a unix socket path is at most " +
                   std::to_string(kMaxSocketPathBytes) + " bytes (sockaddr_un.sun_path)");
  switch (c.backend.type) {
    case BackendType::kPosix:
      if (c.backend.root.empty()) return Bad("backend.root", "required for the posix backend");
      if (!s3_set.empty())
        return Bad("backend." + s3_set.front(), "only for the s3 backend (backend.type: s3)");
      break;
    case BackendType::kS3:
      if (!c.backend.root.empty())
        return Bad("backend.root", "not used by the s3 backend (it serves backend.bucket)");
      CTFS_RETURN_IF_ERROR(ValidateS3(c.backend.s3));
      break;
    case BackendType::kCubefs:
      if (!c.backend.root.empty())
        return Bad("backend.root", "not used by the cubefs backend (it serves the volume volName)");
      if (!s3_set.empty())
        return Bad("backend." + s3_set.front(), "only for the s3 backend (backend.type: s3)");
      CTFS_RETURN_IF_ERROR(ValidateCubefs(c.backend.cubefs));
      break;
    case BackendType::kSynthetic: {
      if (!c.backend.root.empty())
        return Bad("backend.root", "not used by the synthetic backend (it computes its tree)");
      if (!s3_set.empty())
        return Bad("backend." + s3_set.front(), "only for the s3 backend (backend.type: s3)");
      const SyntheticOptions& y = c.backend.synthetic;
      if (y.dirs == 0) return Bad("backend.synthetic.dirs", "must be at least 1");
      if (y.min_bytes > y.max_bytes)
        return Bad("backend.synthetic.min_bytes", "must not exceed backend.synthetic.max_bytes");
      if (y.max_bytes > (1ull << 40))
        return Bad("backend.synthetic.max_bytes", "must be at most 1TiB");
      if (y.dirs * y.files_per_dir > 10'000'000'000ull)
        return Bad("backend.synthetic.files_per_dir", "dirs x files_per_dir must be at most 10^10");
      break;
    }
  }
  if (c.cache.memory_bytes < (1u << 20)) return Bad("cache.memory_bytes", "must be at least 1MiB");
  if (c.cache.chunk_bytes < (64u << 10) || c.cache.chunk_bytes > (1ull << 30))
    return Bad("cache.chunk_bytes", "must be between 64KiB and 1GiB");
  if (!c.cache.disk_dir.empty() && c.cache.disk_bytes == 0)
    return Bad("cache.disk_bytes", "required (above 0) when cache.disk_dir is set");
  if (c.cache.chunk_bytes % 4096 != 0)
    return Bad("cache.chunk_bytes", "must be a multiple of 4KiB");
  if (Result<LogLevel> level = ParseLogLevel(c.log_level); !level.ok())
    return Bad("logLevel", level.status().message());
  if (c.exporter_port != 0 && c.exporter_port == c.prof_port)
    return Bad("profPort", "must differ from exporterPort");
  if (!c.profile.empty() && c.profile != "ai_prefetch")
    return Bad("profile", "unknown profile \"" + c.profile + "\" (known: ai_prefetch)");
  return Status::OK();
}

Result<Config> ParseNode(const YAML::Node& root) {
  if (!root.IsMap()) return Bad("config", "must be an object at the top level");
  Config c;
  FuseExplicit fuse_set;
  std::vector<std::string> s3_set;
  std::optional<YAML::Node> cubefs_rdonly, cubefs_lookup, cubefs_attr;
  for (const auto& kv : root) {
    std::string k = Scalar(kv.first);
    const YAML::Node& v = kv.second;
    if (k == "volName")
      CTFS_ASSIGN(c.vol_name, GetString(v, k));
    else if (k == "mountPoint")
      CTFS_ASSIGN(c.mount_point, GetString(v, k));
    else if (k == "logDir")
      CTFS_ASSIGN(c.log_dir, GetString(v, k));
    else if (k == "logLevel")
      CTFS_ASSIGN(c.log_level, GetString(v, k));
    else if (k == "profile")
      CTFS_ASSIGN(c.profile, GetString(v, k));
    else if (k == "exporterPort" || k == "profPort") {
      uint64_t port = 0;
      if (!(v.IsScalar() && v.Scalar().empty())) CTFS_ASSIGN(port, GetUint(v, k, 65535));
      (k == "exporterPort" ? c.exporter_port : c.prof_port) = static_cast<uint16_t>(port);
    } else if (k == "backend")
      CTFS_RETURN_IF_ERROR(ParseBackend(v, &c.backend, &s3_set));
    else if (k == "cache")
      CTFS_RETURN_IF_ERROR(ParseCache(v, &c.cache));
    else if (k == "prefetch")
      CTFS_RETURN_IF_ERROR(ParsePrefetch(v, &c.prefetch));
    else if (k == "control")
      CTFS_RETURN_IF_ERROR(ParseControl(v, &c.control));
    else if (k == "fuse")
      CTFS_RETURN_IF_ERROR(ParseFuse(v, &c.fuse, &fuse_set));
    else if (k == "rdonly")
      cubefs_rdonly = v;
    else if (k == "lookupValid")
      cubefs_lookup = v;
    else if (k == "attrValid")
      cubefs_attr = v;
    else if (k == "masterAddr")
      CTFS_ASSIGN(c.backend.cubefs.master_addr, GetString(v, k));
    else if (k == "accessKey")
      CTFS_ASSIGN(c.backend.cubefs.access_key, GetString(v, k));
    else if (k == "secretKey")
      CTFS_ASSIGN(c.backend.cubefs.secret_key, GetString(v, k));
    else if (k == "followerRead")
      CTFS_ASSIGN(c.backend.cubefs.follower_read, GetBool(v, k));
    else if (!IsCubeFsClientKey(k))
      c.unknown_top_level_keys.push_back(k);
  }
  if (c.profile == "ai_prefetch") {
    if (!fuse_set.entry) c.fuse.entry_timeout_s = 300;
    if (!fuse_set.attr) c.fuse.attr_timeout_s = 300;
    if (!fuse_set.negative) c.fuse.negative_timeout_s = 5;
    if (!fuse_set.keep_cache) c.fuse.keep_cache = true;
    if (!fuse_set.list_ahead) c.fuse.list_ahead = 16;
  }
  if (cubefs_rdonly && !fuse_set.read_only)
    CTFS_ASSIGN(c.fuse.read_only, GetBool(*cubefs_rdonly, "rdonly"));
  if (cubefs_lookup && !fuse_set.entry)
    CTFS_ASSIGN(c.fuse.entry_timeout_s, GetDouble(*cubefs_lookup, "lookupValid", 0, 86400));
  if (cubefs_attr && !fuse_set.attr)
    CTFS_ASSIGN(c.fuse.attr_timeout_s, GetDouble(*cubefs_attr, "attrValid", 0, 86400));
  if (c.backend.s3.bucket.empty()) c.backend.s3.bucket = c.vol_name;
  if (c.backend.cubefs.volume.empty()) c.backend.cubefs.volume = c.vol_name;
  c.backend.cubefs.log_dir = c.log_dir;
  for (const char* level : {"debug", "info", "warn", "error"})
    if (c.log_level == level) c.backend.cubefs.log_level = level;
  while (!c.backend.s3.prefix.empty() && c.backend.s3.prefix.back() == '/')
    c.backend.s3.prefix.pop_back();
  while (!c.backend.s3.endpoint.empty() && c.backend.s3.endpoint.back() == '/')
    c.backend.s3.endpoint.pop_back();
  CTFS_RETURN_IF_ERROR(Validate(c, s3_set));
  if (const uint64_t phys = PhysicalMemoryBytes(); phys != 0 && c.cache.memory_bytes > phys)
    c.warnings.push_back("cache.memory_bytes: " + std::to_string(c.cache.memory_bytes) +
                         " bytes is more than this machine's physical memory (" +
                         std::to_string(phys) + " bytes); the cache will swap or be killed");
  return c;
}

Result<Config> ParseConfigText(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + ": not valid JSON or YAML at line " +
                                   std::to_string(e.mark.line + 1) + ", column " +
                                   std::to_string(e.mark.column + 1) + ": " + e.msg);
  }
  try {
    CTFS_RETURN_IF_ERROR(CheckKeys(text));
    return ParseNode(root);
  } catch (const YAML::Exception& e) {  // a malformed node yaml-cpp only notices on access
    return Status::InvalidArgument(source + ": " + e.what());
  }
}

}  // namespace

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

Result<BackendType> ParseBackendType(const std::string& name) {
  std::string known;
  for (BackendType t :
       {BackendType::kPosix, BackendType::kS3, BackendType::kCubefs, BackendType::kSynthetic}) {
    if (name == BackendTypeName(t)) return t;
    known += (known.empty() ? "" : ", ");
    known += BackendTypeName(t);
  }
  return Bad("backend.type", "unknown backend \"" + name + "\" (known: " + known + ")");
}

const char* BackendTypeName(BackendType type) {
  switch (type) {
    case BackendType::kPosix:
      return "posix";
    case BackendType::kS3:
      return "s3";
    case BackendType::kCubefs:
      return "cubefs";
    case BackendType::kSynthetic:
      return "synthetic";
  }
  return "unknown";
}

std::string ControlSocketPath(const Config& config) {
  return config.prefetch.control_socket.empty() ? "/run/cubetorchfs/" + config.vol_name + ".sock"
                                                : config.prefetch.control_socket;
}

// Runs `fn`, turning whatever it throws (yaml-cpp, std::length_error, std::bad_alloc) and
// any error it returns into one error line naming `source`.
template <typename Fn>
Result<Config> OneLineErrors(const std::string& source, Fn&& fn) {
  try {
    Result<Config> c = fn();
    if (!c.ok()) return OneLine(c.status());
    return c;
  } catch (const std::bad_alloc&) {
    return OneLine(Status::InvalidArgument(source + ": out of memory reading the config"));
  } catch (const std::exception& e) {
    return OneLine(Status::InvalidArgument(source + ": " + e.what()));
  } catch (...) {
    return OneLine(Status::InvalidArgument(source + ": unexpected error reading the config"));
  }
}

Result<Config> ParseConfig(const std::string& text, const std::string& source) {
  return OneLineErrors(source, [&] { return ParseConfigText(text, source); });
}

Result<Config> LoadConfig(const std::string& path) {
  return OneLineErrors(path, [&]() -> Result<Config> {
    CTFS_ASSIGN_OR_RETURN(std::string text, ReadConfigFile(path));
    Result<Config> c = ParseConfigText(text, path);
    if (c.ok())
      for (const std::string& w : c->warnings) CTFS_LOG(kWarn) << w;
    return c;
  });
}

}  // namespace cubetorchfs::conf
