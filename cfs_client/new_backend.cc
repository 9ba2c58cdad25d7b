// Which backend a config builds, what each type can do, and the checks made before serving:
// the one place in cfs_client that looks at backend.type.

#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cfs_client/backend.h"
#include "conf/config.h"

namespace cubetorchfs::cfs_client {

Capabilities CapabilitiesOfType(conf::BackendType type) {
  Capabilities c;
  switch (type) {
    case conf::BackendType::kPosix:
      c.has_owners = true;
      c.hands_out_fds = true;
      break;
    case conf::BackendType::kS3:
      c.has_owners = false;  // one owner and mode for every object, no symlinks
      c.lookup_returns_data = true;
      break;
    case conf::BackendType::kCubefs:
      c.has_owners = true;
      c.writes_own_logs = true;
      break;
    case conf::BackendType::kSynthetic:
      c.has_owners = true;
      break;
  }
  return c;
}

Capabilities CapabilitiesOf(const conf::BackendOptions& opts) {
  Capabilities c = CapabilitiesOfType(opts.type);
  if (opts.inject.enabled) c = InjectedCapabilities(c, opts.inject);
  return c;
}

Status CheckBackend(conf::BackendOptions* opts) {
  switch (opts->type) {
    case conf::BackendType::kPosix: {
      char buf[PATH_MAX];
      if (::realpath(opts->root.c_str(), buf) == nullptr)
        return Status::NotFound("backend.root: " + opts->root + ": " + std::strerror(errno));
      opts->root = buf;
      Result<std::unique_ptr<Backend>> probe = NewPosixBackend(opts->root);
      if (!probe.ok()) return Status::InvalidArgument("backend.root: " + probe.status().message());
      return Status::OK();
    }
    case conf::BackendType::kS3:
      return CheckS3Backend(opts->s3);  // names backend.endpoint, .bucket, ...
    case conf::BackendType::kCubefs: {
      // The library itself is loaded (and the volume reached) only after daemonizing: its Go
      // runtime must not be forked.
      const std::string& lib = opts->cubefs.lib;
      if (lib.find('/') != std::string::npos && ::access(lib.c_str(), R_OK) != 0)
        return Status::NotFound("backend.cubefs.lib: " + lib + ": " + std::strerror(errno));
      return Status::OK();
    }
    case conf::BackendType::kSynthetic:
      return Status::OK();
  }
  return Status::OK();
}

Result<std::unique_ptr<Backend>> NewBackend(const conf::BackendOptions& opts,
                                            prometheus::Registry& registry, Clock* clock) {
  Result<std::unique_ptr<Backend>> base = Status::InvalidArgument("backend.type: unknown backend");
  switch (opts.type) {
    case conf::BackendType::kPosix:
      base = NewPosixBackend(opts.root);
      if (!base.ok()) return Status::InvalidArgument("backend.root: " + base.status().message());
      break;
    case conf::BackendType::kS3:
      base = NewS3Backend(opts.s3);
      break;
    case conf::BackendType::kCubefs:
      base = NewCubefsBackend(opts.cubefs);
      break;
    case conf::BackendType::kSynthetic:
      base = NewSyntheticBackend(opts.synthetic);
      break;
  }
  if (!base.ok()) return base.status();
  std::unique_ptr<Backend> b = std::move(base).value();
  if (opts.inject.enabled) b = NewInjectBackend(std::move(b), opts.inject, clock);
  return NewMeteredBackend(std::move(b), registry, clock, StoreName(opts));
}

std::string StoreName(const conf::BackendOptions& opts) {
  switch (opts.type) {
    case conf::BackendType::kPosix:
      return opts.root;
    case conf::BackendType::kS3:
      return opts.s3.endpoint + "/" + opts.s3.bucket;
    case conf::BackendType::kCubefs:
      return "cubefs://" + opts.cubefs.master_addr + "/" + opts.cubefs.volume;
    case conf::BackendType::kSynthetic:
      break;
  }
  return conf::BackendTypeName(opts.type);
}

}  // namespace cubetorchfs::cfs_client
