#include "loader/model_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>

#include "common/parallel.h"
#include "common/thread_annotations.h"
#include "crypto/encrypted_header.h"
#include "crypto/key_source.h"
#include "loader/daemon_fd.h"

namespace cubetorchfs::loader {

namespace {

constexpr uint64_t kDirectAlign = 4096;
// Encrypted files are read, authenticated and decrypted in pieces of this size.
constexpr uint64_t kCipherBlock = 512 << 10;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// No key source is the caller's to fix (InvalidArgument), not a missing file.
Status KeyError(const std::string& path, const Status& s) {
  if (s.IsNotFound()) return Status::InvalidArgument(path + ": " + s.message());
  return s.Wrap(path + ": ");
}

int OpenTimeoutMs() {
  const char* v = std::getenv("CUBE_TORCH_OPEN_TIMEOUT_S");
  long s = v ? std::strtol(v, nullptr, 10) : 0;
  return s > 0 && s < 86400 ? static_cast<int>(s * 1000) : 600 * 1000;
}

}  // namespace

const char* SourceName(Source source) {
  switch (source) {
    case Source::kDirect:
      return "direct";
    case Source::kDaemonFd:
      return "daemon-fd";
    case Source::kMount:
      return "mount";
  }
  return "?";
}

int DefaultIoThreads() {
  if (const char* v = std::getenv("CUBE_TORCH_IO_THREADS")) {
    long n = std::strtol(v, nullptr, 10);
    if (n >= 1 && n <= 256) return static_cast<int>(n);
  }
  int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(2 * hw, 4, 32);
}

ModelFile::~ModelFile() {
  if (fd_ < 0) return;
  if (source_ == Source::kDaemonFd) {
    // The last close of the daemon's memory file frees all its pages, which takes a while
    // for a big model (0.15 s per GiB here): let it happen off the caller's path.
    const int fd = fd_;
    if (RunDetached([fd] { ::close(fd); })) return;
  }
  ::close(fd_);
}

Status ModelFile::PreadFull(uint8_t* dst, uint64_t len, uint64_t file_offset,
                            std::vector<uint8_t>* bounce) {
  if (direct_) {
    // O_DIRECT wants aligned offsets, lengths and memory: read the aligned cover of the range
    // into an aligned bounce buffer and copy out what was asked for.
    const uint64_t begin = file_offset / kDirectAlign * kDirectAlign;
    const uint64_t end = (file_offset + len + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    const uint64_t cover = end - begin;
    if (bounce->size() < cover + kDirectAlign) bounce->resize(cover + kDirectAlign);
    uint8_t* aligned = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(bounce->data()) + kDirectAlign - 1) / kDirectAlign *
        kDirectAlign);
    uint64_t got = 0;
    while (got < cover) {
      ssize_t n = ::pread(fd_, aligned + got, cover - got, static_cast<off_t>(begin + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::IOError(Errno(path_ + ": read"));
      if (n == 0) break;  // end of file (the last block is short)
      got += static_cast<uint64_t>(n);
    }
    if (got < file_offset - begin + len)
      return Status::Corruption(path_ +
                                ": file is shorter than its header says (changed while loading?)");
    std::memcpy(dst, aligned + (file_offset - begin), len);
    return Status::OK();
  }
  uint64_t done = 0;
  while (done < len) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(len - done, 1ull << 30));
    ssize_t n = ::pread(fd_, dst + done, want, static_cast<off_t>(file_offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOError(Errno(path_ + ": read"));
    if (n == 0)
      return Status::Corruption(path_ +
                                ": file is shorter than its header says (changed while loading?)");
    done += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

Result<std::unique_ptr<ModelFile>> ModelFile::Open(const std::string& path,
                                                   const OpenOptions& options) {
  std::unique_ptr<ModelFile> f(new ModelFile());
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) {
    if (errno == ENOENT || errno == ENOTDIR) return Status::NotFound(path + ": no such file");
    return Status::IOError(Errno(path));
  }
  f->path_ = resolved;

  if (options.use_daemon) CTFS_RETURN_IF_ERROR(f->TryDaemon(path));
  if (f->fd_ < 0) CTFS_RETURN_IF_ERROR(f->OpenLocal(path, options.direct_io));
  struct stat st;
  if (::fstat(f->fd_, &st) != 0) return Status::IOError(Errno(path + ": stat"));
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(path + ": not a regular file");
  f->file_size_ = static_cast<uint64_t>(st.st_size);

  std::vector<uint8_t> bounce;
  CTFS_RETURN_IF_ERROR(f->SetUpCipher(path, options.cipher, &bounce));
  if (options.require_integrity && !f->integrity_)
    return Status::Corruption(path +
                              ": the file carries no integrity tag and one is required "
                              "(require_integrity / CUBE_TORCH_REQUIRE_INTEGRITY)");
  f->payload_size_ = f->file_size_ - f->payload_base_;
  CTFS_RETURN_IF_ERROR(f->ReadHeader(path, &bounce));
  return f;
}

int ModelFile::MappableFd(uint64_t* data_file_offset) const {
  if (encrypted_ || integrity_.has_value() || direct_ || fd_ < 0) return -1;
  if (data_file_offset != nullptr) *data_file_offset = payload_base_ + header_.data_offset;
  return fd_;
}

// Takes fd_ from the daemon when path_ is under a cubetorchfs mount; fails only on NotFound.
Status ModelFile::TryDaemon(const std::string& path) {
  if (std::optional<MountOf> mount = FindCubetorchfsMount(path_)) {
    source_ = Source::kMount;
    Result<std::string> sock = ControlSocketOf(mount->vol_name);
    if (sock.ok()) {
      Result<DaemonFile> df = OpenViaDaemon(*sock, mount->StorePath(path_), OpenTimeoutMs());
      struct stat through_mount;
      if (df.ok() && ::stat(path_.c_str(), &through_mount) == 0 &&
          static_cast<uint64_t>(through_mount.st_size) != df->size) {
        ::close(df->fd);  // not the file the mount shows (changed meanwhile?): read that one
      } else if (df.ok()) {
        fd_ = df->fd;
        source_ = Source::kDaemonFd;
      } else if (df.status().IsNotFound()) {
        return Status::NotFound(path + ": no such file");
      }
    }
  }
  return Status::OK();
}

// Opens path_ read-only (with O_DIRECT when asked and the file system allows it) into fd_.
Status ModelFile::OpenLocal(const std::string& path, bool direct_io) {
  int flags = O_RDONLY | O_CLOEXEC;
  if (direct_io) {
    fd_ = ::open(path_.c_str(), flags | O_DIRECT);
    direct_ = fd_ >= 0;  // file systems without O_DIRECT (tmpfs) read buffered
  }
  if (fd_ < 0) fd_ = ::open(path_.c_str(), flags);
  if (fd_ < 0) return Status::IOError(Errno(path));
  return Status::OK();
}

// Sets up decryption from the encrypted header if any, else headerless when `choice` is kOn.
Status ModelFile::SetUpCipher(const std::string& path, CipherChoice choice,
                              std::vector<uint8_t>* bounce) {
  uint8_t magic[16] = {};
  const bool has_magic = file_size_ >= sizeof(magic) &&
                         PreadFull(magic, sizeof(magic), 0, bounce).ok() &&
                         crypto::HasEncryptedHeaderMagic(magic, sizeof(magic));
  if (has_magic) {
    if (choice == CipherChoice::kOff)
      return Status::InvalidArgument(path +
                                     ": the file has the encrypted-model header; load it "
                                     "with use_cipher=True (or None)");
    return ReadEncryptedHeader(path, bounce);
  }
  if (choice == CipherChoice::kOn) {
    Result<crypto::CipherParams> params = crypto::ResolveCipherParams(nullptr);
    if (!params.ok()) return KeyError(path, params.status());
    cipher_ = std::move(params.value());
    encrypted_ = true;
  }
  return Status::OK();
}

// Reads and checks the encrypted header: sets cipher_, integrity_ and payload_base_.
Status ModelFile::ReadEncryptedHeader(const std::string& path, std::vector<uint8_t>* bounce) {
  if (file_size_ < crypto::kEncryptedHeaderSize)
    return Status::Corruption(path + ": encrypted header truncated (file of " +
                              std::to_string(file_size_) + " bytes)");
  std::vector<uint8_t> raw(crypto::kEncryptedHeaderSize);
  CTFS_RETURN_IF_ERROR(PreadFull(raw.data(), raw.size(), 0, bounce));
  Result<crypto::EncryptedHeader> h = crypto::ParseEncryptedHeader(raw.data(), raw.size());
  if (!h.ok()) return Status::Corruption(path + ": " + h.status().message());
  Result<crypto::CipherParams> params = crypto::ResolveCipherParams(&h.value());
  if (!params.ok()) return KeyError(path, params.status());
  Result<std::optional<crypto::IntegrityField>> integrity = crypto::GetIntegrityField(*h);
  if (!integrity.ok()) return Status::Corruption(path + ": " + integrity.status().message());
  // The header is not authenticated: bound what it may ask of the reader (the writer
  // uses 4 MiB; tiny chunks would cost a MAC setup and 16 bytes of tag per chunk).
  if (*integrity &&
      ((*integrity)->chunk_size < (64u << 10) || (*integrity)->chunk_size > (1ull << 30) ||
       (*integrity)->chunk_size % crypto::kAesBlockSize != 0))
    return Status::Corruption(path + ": integrity chunk_size " +
                              std::to_string((*integrity)->chunk_size) +
                              " is out of range (64 KiB to 1 GiB, a multiple of 16)");
  integrity_ = *integrity;
  cipher_ = std::move(params.value());
  encrypted_ = true;
  payload_base_ = crypto::kEncryptedHeaderSize;
  return Status::OK();
}

// Reads, decrypts and parses the safetensors header into header_ (and header_ciphertext_).
Status ModelFile::ReadHeader(const std::string& path, std::vector<uint8_t>* bounce) {
  const std::string hint = encrypted_ ? " (encrypted file: wrong key or IV?)" : "";
  uint8_t first8[8] = {};
  const size_t have8 = static_cast<size_t>(std::min<uint64_t>(8, payload_size_));
  CTFS_RETURN_IF_ERROR(PreadFull(first8, have8, payload_base_, bounce));
  std::vector<uint8_t> first8_cipher(first8, first8 + have8);
  if (encrypted_)
    CTFS_RETURN_IF_ERROR(crypto::CtrXorAt(cipher_->key, cipher_->iv, 0, first8, have8));
  Result<uint64_t> n = HeaderLength(first8, have8, payload_size_);
  if (!n.ok()) return n.status().Wrap(path + ": ", hint);
  std::vector<uint8_t> json(static_cast<size_t>(*n));
  CTFS_RETURN_IF_ERROR(PreadFull(json.data(), json.size(), payload_base_ + 8, bounce));
  if (integrity_) {
    header_ciphertext_ = first8_cipher;
    header_ciphertext_.insert(header_ciphertext_.end(), json.begin(), json.end());
  }
  if (encrypted_)
    CTFS_RETURN_IF_ERROR(crypto::CtrXorAt(cipher_->key, cipher_->iv, 8, json.data(), json.size()));
  Result<Header> header = ParseHeaderJson(json.data(), json.size(), payload_size_);
  if (!header.ok()) return header.status().Wrap(path + ": ", hint);
  header_ = std::move(header.value());
  return Status::OK();
}

Status ModelFile::ReadData(uint8_t* dst, uint64_t len, const ReadOptions& options) {
  if (len != data_size())
    return Status::InvalidArgument(path_ + ": destination of " + std::to_string(len) +
                                   " bytes for a data section of " + std::to_string(data_size()));
  return ReadPlan(
      options, [dst](uint64_t off, uint64_t) -> Result<uint8_t*> { return dst + off; }, nullptr,
      false);
}

Status ModelFile::ReadDataStaged(const StageFn& stage, const SinkFn& sink, bool leave_encrypted,
                                 const ReadOptions& options) {
  return ReadPlan(options, stage, sink, leave_encrypted && encrypted_);
}

uint64_t ModelFile::ItemBytes(const ReadOptions& options) const {
  if (integrity_) return integrity_->chunk_size;
  return std::max<uint64_t>(options.chunk_bytes, 1 << 20);
}

// One ReadPlan call's inputs, shared read-only by its threads.
struct ModelFile::Plan {
  const StageFn& stage;
  const SinkFn& sink;
  bool leave_encrypted;
  uint64_t unit;                                // bytes per work item
  std::optional<crypto::IntegrityKey> mac_key;  // only with an integrity tag
  crypto::IntegrityParams params;               // likewise
};

Status ModelFile::ReadPlan(const ReadOptions& options, const StageFn& stage, const SinkFn& sink,
                           bool leave_encrypted) {
  const uint64_t total = data_size();
  // Work items. With an integrity tag an item is one tag chunk (payload coordinates), so each
  // thread can compute its chunk's tag from the ciphertext it read; otherwise items are
  // chunk_bytes of the data section.
  Plan plan{stage, sink, leave_encrypted, ItemBytes(options), std::nullopt, {}};
  const uint64_t unit = plan.unit;
  const uint64_t first = 0;
  const uint64_t count = integrity_ ? (payload_size_ + unit - 1) / unit : (total + unit - 1) / unit;
  std::vector<crypto::ChunkTagValue> tags(integrity_ ? count : 0);
  if (integrity_) {
    CTFS_ASSIGN_OR_RETURN(crypto::IntegrityKey k,
                          crypto::IntegrityKey::Derive(cipher_->key, cipher_->iv));
    plan.mac_key = k;
    plan.params.iv = cipher_->iv;
    plan.params.payload_size = payload_size_;
    plan.params.chunk_size = unit;
  }

  std::atomic<uint64_t> next{first};
  std::atomic<bool> failed{false};
  Mutex mu;
  Status first_error;
  auto worker = [&]() {
    std::vector<uint8_t> bounce;
    crypto::ChunkMac mac;
    for (;;) {
      if (failed.load()) return;
      const uint64_t i = next.fetch_add(1);
      if (i >= count) return;
      Status s = ReadItem(plan, i, &mac, &bounce, integrity_ ? &tags[i] : nullptr);
      if (!s.ok()) {
        MutexLock lock(mu);
        if (first_error.ok()) first_error = std::move(s);
        failed = true;
        return;
      }
    }
  };
  int threads = options.threads > 0 ? options.threads : DefaultIoThreads();
  threads = static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(threads), count));
  RunOnThreads(threads, worker);
  if (!first_error.ok()) return first_error;
  if (integrity_) {
    CTFS_ASSIGN_OR_RETURN(crypto::Tag root,
                          crypto::CombineChunkTags(*plan.mac_key, plan.params, tags));
    Status s = crypto::CheckIntegrityTag(root, integrity_->tag);
    if (!s.ok())
      return Status::Corruption(path_ + ": " + s.message() +
                                " — the file was modified or damaged; not loading it");
  }
  return Status::OK();
}

// Reads work item i into `stage`'s memory and hands it to `sink`; sets *tag if integrity_.
Status ModelFile::ReadItem(const Plan& plan, uint64_t i, crypto::ChunkMac* mac,
                           std::vector<uint8_t>* bounce, crypto::ChunkTagValue* tag) {
  const uint64_t data_off = header_.data_offset;
  const uint64_t unit = plan.unit;
  // The item's data-section range [d_begin, d_end).
  uint64_t d_begin, d_end, p_begin = 0, p_end = 0;
  if (integrity_) {
    p_begin = i * unit;
    p_end = std::min(payload_size_, p_begin + unit);
    d_begin = std::max(p_begin, data_off) - data_off;
    d_end = std::max(p_end, data_off) - data_off;
  } else {
    d_begin = i * unit;
    d_end = std::min(data_size(), d_begin + unit);
  }
  const uint64_t len = d_end - d_begin;
  uint8_t* ptr = nullptr;
  if (len > 0) {
    CTFS_ASSIGN_OR_RETURN(ptr, plan.stage(d_begin, len));
  }
  const uint64_t file_off = payload_base_ + data_off + d_begin;
  if (!encrypted_) {
    if (len > 0) CTFS_RETURN_IF_ERROR(PreadFull(ptr, len, file_off, bounce));
  } else {
    // Encrypted: in sub-blocks small enough to stay in the core's cache between the
    // read, the chunk MAC (over the ciphertext) and the decryption.
    if (integrity_) {
      CTFS_RETURN_IF_ERROR(mac->Begin(*plan.mac_key, plan.params, i));
      // Any part of the chunk before the data section is header bytes kept at open.
      if (p_begin < data_off)
        CTFS_RETURN_IF_ERROR(
            mac->Update(header_ciphertext_.data() + p_begin, std::min(p_end, data_off) - p_begin));
    }
    for (uint64_t at = 0; at < len; at += kCipherBlock) {
      const uint64_t n = std::min(kCipherBlock, len - at);
      CTFS_RETURN_IF_ERROR(PreadFull(ptr + at, n, file_off + at, bounce));
      if (integrity_) CTFS_RETURN_IF_ERROR(mac->Update(ptr + at, n));
      if (!plan.leave_encrypted)
        CTFS_RETURN_IF_ERROR(
            crypto::CtrXorAt(cipher_->key, cipher_->iv, data_off + d_begin + at, ptr + at, n));
    }
    if (integrity_) {
      CTFS_ASSIGN_OR_RETURN(*tag, mac->Finish());
    }
  }
  if (len == 0) return Status::OK();
  if (plan.sink) CTFS_RETURN_IF_ERROR(plan.sink(d_begin, len, ptr));
  return Status::OK();
}

}  // namespace cubetorchfs::loader
