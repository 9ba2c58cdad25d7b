// Internal to cfs_client/: a file of the s3 backend open for writing, held in a local staging
// file and uploaded on Flush/Sync (the mapping and the upload rules are at the top of
// s3_backend.cc).
//
// Thread safety: a WritableFile's methods may be called from any thread; one mutex serializes
// them, uploads included.
#pragma once

#include <memory>
#include <string>

#include "cfs_client/backend.h"
#include "common/status.h"

namespace cubetorchfs::cfs_client {

// What a staged file needs of the backend it belongs to.
class S3FileHost {
 public:
  virtual ~S3FileHost() = default;
  // Uploads the staging file open as `fd` to the object of `path` (one PUT or a multipart
  // upload).
  virtual Status UploadStaged(const std::string& path, int fd) = 0;
  // Reads the object's bytes at `version` (a ranged GET).
  virtual Result<size_t> ReadObject(const std::string& path, const FileVersion& version,
                                    uint64_t offset, size_t len, char* buf) = 0;
  // How the object of `path` is named in messages (bucket and key).
  virtual std::string ShowPath(const std::string& path) const = 0;
};

// `attr`: the object's attributes when opened (if `exists`; its bytes are fetched into the
// staging file when first needed), else those of a new file. `empty`: the file starts empty
// (new or truncated). Takes `fd`, the open staging file at `staging`.
std::unique_ptr<WritableFile> NewS3WritableFile(S3FileHost* host, std::string path,
                                                const FileAttr& attr, bool exists, bool empty,
                                                std::string staging, int fd);

}  // namespace cubetorchfs::cfs_client
