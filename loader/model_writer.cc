#include "loader/model_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "common/parallel.h"
#include "common/thread_annotations.h"
#include "crypto/encrypted_header.h"
#include "crypto/integrity.h"
#include "crypto/key_source.h"
#include "loader/model_file.h"

namespace cubetorchfs::loader {

namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

Status PwriteFull(int fd, const uint8_t* data, uint64_t len, uint64_t offset,
                  const std::string& path) {
  uint64_t done = 0;
  while (done < len) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(len - done, 1ull << 30));
    ssize_t n = ::pwrite(fd, data + done, want, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOError(Errno(path + ": write"));
    done += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

// The payload as a list of pieces: the safetensors header, then each tensor's bytes.
class Payload {
 public:
  void Add(const uint8_t* p, uint64_t len) {
    if (len == 0) return;
    starts_.push_back(size_);
    pieces_.push_back({p, len});
    size_ += len;
  }
  uint64_t size() const { return size_; }
  // Calls fn(ptr, len) for the bytes of payload [offset, offset + len), in order.
  template <typename Fn>
  Status ForEach(uint64_t offset, uint64_t len, Fn&& fn) const {
    auto it = std::upper_bound(starts_.begin(), starts_.end(), offset);
    size_t i = static_cast<size_t>(it - starts_.begin()) - 1;
    while (len > 0 && i < pieces_.size()) {
      const uint64_t within = offset - starts_[i];
      const uint64_t n = std::min(len, pieces_[i].second - within);
      CTFS_RETURN_IF_ERROR(fn(pieces_[i].first + within, n));
      offset += n;
      len -= n;
      ++i;
    }
    return Status::OK();
  }

 private:
  std::vector<std::pair<const uint8_t*, uint64_t>> pieces_;
  std::vector<uint64_t> starts_;
  uint64_t size_ = 0;
};

// Runs fn(i) for i in [0, count) on up to `threads` threads; the first error wins.
Status ParallelFor(uint64_t count, int threads, const std::function<Status(uint64_t)>& fn) {
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  Mutex mu;
  Status first;
  auto worker = [&] {
    for (;;) {
      if (failed) return;
      uint64_t i = next.fetch_add(1);
      if (i >= count) return;
      Status s = fn(i);
      if (!s.ok()) {
        MutexLock lock(mu);
        if (first.ok()) first = s;
        failed = true;
      }
    }
  };
  RunOnThreads(
      static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(std::max(threads, 1)), count)),
      worker);
  return first;
}

// Returns the safetensors JSON header for `tensors` (padded); sets *data_size to the data size.
Result<std::string> HeaderJson(const std::vector<SaveTensor>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               uint64_t* data_size) {
  // The header, with offsets in the order given.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SaveTensor& t : tensors) {
    if (t.name == "__metadata__")
      return Status::InvalidArgument("tensor name '__metadata__' is reserved by the format");
    if (!names.insert(t.name).second)
      return Status::InvalidArgument("tensor '" + t.name + "' appears twice");
    if (t.len > 0 && t.data == nullptr)
      return Status::InvalidArgument("tensor '" + t.name + "': no data");
    header[t.name] = {{"dtype", DtypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.len}}};
    offset += t.len;
  }
  std::string json = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  while ((8 + json.size()) % 8 != 0) json.push_back(' ');
  *data_size = offset;
  return json;
}

// Returns `json` behind its 8-byte little-endian length: the payload's first bytes.
std::string LengthPrefixed(const std::string& json) {
  std::string prefix(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i)
    prefix[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  prefix += json;
  return prefix;
}

// Resolves the key and makes a fresh encrypted header for an encrypted save of `path`.
Status NewSaveCipher(const std::string& path, std::optional<crypto::EncryptedHeader>* enc,
                     std::optional<crypto::Key>* key) {
  Result<crypto::KeyMaterial> km = crypto::ResolveKey(nullptr);
  if (!km.ok()) {
    // No key source is a usage error here, not a missing file.
    if (km.status().IsNotFound())
      return Status::InvalidArgument("save " + path + " encrypted: " + km.status().message());
    return km.status().Wrap("save " + path + " encrypted: ");
  }
  const auto mode =
      km->key.size() == 32 ? crypto::CipherMode::kCtr256 : crypto::CipherMode::kCtr128;
  CTFS_ASSIGN_OR_RETURN(crypto::EncryptedHeader h,
                        crypto::NewEncryptedHeader(mode, std::time(nullptr)));
  *enc = h;
  *key = km->key;
  return Status::OK();
}

// Creates a temp file beside `path`; returns its fd, its name (or the last tried) in *tmp.
Result<int> CreateTempFile(const std::string& path, std::string* tmp) {
  // A new temp file of unpredictable name (O_EXCL, O_NOFOLLOW): in a shared directory a file
  // or symlink planted at a guessable name is never written through.
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    std::random_device rd;
    char suffix[24];
    std::snprintf(suffix, sizeof(suffix), ".%08x%08x", rd(), rd());
    *tmp = path + ".tmp." + std::to_string(::getpid()) + suffix;
    fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return Status::IOError(Errno("save " + *tmp));
  return fd;
}

// Writes the plain payload to fd at offset 0, in 8 MiB pieces on `threads` threads.
Status WritePlain(int fd, const std::string& tmp, const Payload& payload, uint64_t payload_size,
                  int threads) {
  const uint64_t unit = 8ull << 20;
  return ParallelFor((payload_size + unit - 1) / unit, threads, [&](uint64_t i) {
    uint64_t pos = i * unit;
    return payload.ForEach(pos, std::min(unit, payload_size - pos),
                           [&](const uint8_t* p, uint64_t len) {
                             Status w = PwriteFull(fd, p, len, pos, tmp);
                             pos += len;
                             return w;
                           });
  });
}

// Writes the payload encrypted, chunk by chunk, then *enc with its integrity tag at offset 0.
Status WriteEncrypted(int fd, const std::string& tmp, const Payload& payload, uint64_t payload_size,
                      int threads, const crypto::Key& key, crypto::EncryptedHeader* enc) {
  const uint64_t base = crypto::kEncryptedHeaderSize;
  crypto::IntegrityParams params;
  params.iv = enc->iv;
  params.payload_size = payload_size;
  const uint64_t unit = params.chunk_size;
  CTFS_ASSIGN_OR_RETURN(crypto::IntegrityKey mac, crypto::IntegrityKey::Derive(key, enc->iv));
  std::vector<crypto::ChunkTagValue> tags(crypto::IntegrityChunkCount(params));
  // Encrypts, MACs and writes chunk i, setting tags[i].
  auto write_chunk = [&](uint64_t i) -> Status {
    thread_local std::vector<uint8_t> buf;
    const uint64_t pos = i * unit;
    const uint64_t len = std::min(unit, payload_size - pos);
    buf.resize(len);
    uint64_t at = 0;
    CTFS_RETURN_IF_ERROR(payload.ForEach(pos, len, [&](const uint8_t* p, uint64_t l) {
      std::memcpy(buf.data() + at, p, l);
      at += l;
      return Status::OK();
    }));
    // Encrypt, then MAC the ciphertext, a cache-sized piece at a time.
    crypto::ChunkMac chunk_mac;
    CTFS_RETURN_IF_ERROR(chunk_mac.Begin(mac, params, i));
    constexpr uint64_t kPiece = 512 << 10;
    for (uint64_t off = 0; off < len; off += kPiece) {
      const uint64_t piece = std::min(kPiece, len - off);
      CTFS_RETURN_IF_ERROR(crypto::CtrXorAt(key, enc->iv, pos + off, buf.data() + off, piece));
      CTFS_RETURN_IF_ERROR(chunk_mac.Update(buf.data() + off, piece));
    }
    CTFS_ASSIGN_OR_RETURN(crypto::ChunkTagValue t, chunk_mac.Finish());
    tags[i] = t;
    return PwriteFull(fd, buf.data(), len, base + pos, tmp);
  };
  CTFS_RETURN_IF_ERROR(ParallelFor(tags.size(), threads, write_chunk));
  CTFS_ASSIGN_OR_RETURN(crypto::Tag root, crypto::CombineChunkTags(mac, params, tags));
  crypto::SetIntegrityField(enc, crypto::IntegrityField{unit, root});
  CTFS_ASSIGN_OR_RETURN(std::string bytes, crypto::SerializeEncryptedHeader(*enc));
  return PwriteFull(fd, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), 0, tmp);
}

// Fsyncs the directory holding `path`, best effort.
void SyncParentDir(const std::string& path) {
  std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
  if (dir.empty()) dir = "/";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some file systems refuse fsync on directories
    ::close(dfd);
  }
}

}  // namespace

Status SaveSafetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const SaveOptions& options) {
  uint64_t data_size = 0;
  CTFS_ASSIGN_OR_RETURN(const std::string json, HeaderJson(tensors, metadata, &data_size));
  const uint64_t payload_size = 8 + json.size() + data_size;
  // Let the parser judge the header we made: every rule it enforces on load holds on save.
  Result<Header> check =
      ParseHeaderJson(reinterpret_cast<const uint8_t*>(json.data()), json.size(), payload_size);
  if (!check.ok()) return check.status().Wrap("save " + path + ": ");

  const std::string prefix = LengthPrefixed(json);
  Payload payload;
  payload.Add(reinterpret_cast<const uint8_t*>(prefix.data()), prefix.size());
  for (const SaveTensor& t : tensors) payload.Add(t.data, t.len);

  std::optional<crypto::EncryptedHeader> enc;
  std::optional<crypto::Key> key;
  if (options.encrypt) CTFS_RETURN_IF_ERROR(NewSaveCipher(path, &enc, &key));
  const uint64_t base = enc ? crypto::kEncryptedHeaderSize : 0;

  std::string tmp;
  CTFS_ASSIGN_OR_RETURN(const int fd, CreateTempFile(path, &tmp));
  auto cleanup = [&](Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  const int threads = options.threads > 0 ? options.threads : DefaultIoThreads();
  Status s = enc ? WriteEncrypted(fd, tmp, payload, payload_size, threads, *key, &*enc)
                 : WritePlain(fd, tmp, payload, payload_size, threads);
  if (!s.ok()) return cleanup(s);
  if (::ftruncate(fd, static_cast<off_t>(base + payload_size)) != 0)
    return cleanup(Status::IOError(Errno("save " + tmp + ": truncate")));
  if (::fsync(fd) != 0) return cleanup(Status::IOError(Errno("save " + tmp + ": fsync")));
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Status::IOError(Errno("save " + tmp + ": close"));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status e = Status::IOError(Errno("save " + path + ": rename"));
    ::unlink(tmp.c_str());
    return e;
  }
  // Make the rename durable.
  SyncParentDir(path);
  return Status::OK();
}

}  // namespace cubetorchfs::loader
