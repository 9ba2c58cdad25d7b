// A safetensors model file opened for loading: plain or veTurboIO-encrypted (with or without
// the 256 KiB header), from a local path, through a cubetorchfs mount, or from a file
// descriptor the daemon handed over (see docs/fd_exchange.md).
//
// Open() reads and validates the safetensors header (decrypting it when needed); ReadData()
// then reads the whole data section into caller memory with many threads, each `pread`-ing
// its own range, decrypting it in place and, for files carrying our integrity tag, computing
// that range's chunk tag from the ciphertext before decrypting it. The tag is checked once
// every range is in: a mismatch is Corruption and the caller must not use the bytes.
//
// Layout: the payload is the safetensors bytes (8-byte length, JSON header, data). It starts
// at file offset 262,144 when the file has the encrypted header, else at 0. The data section
// is payload [data_offset, payload_size).
//
// Thread safety: a ModelFile is used by one caller at a time; ReadData spreads its own work
// over threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "crypto/aes_ctr.h"
#include "crypto/integrity.h"
#include "crypto/key_source.h"
#include "loader/safetensors.h"

namespace cubetorchfs::loader {

enum class CipherChoice {
  kAuto,  // encrypted if the file starts with the header magic, else plain
  kOff,   // plain; a file with the header magic is an error (it would load garbage)
  kOn,    // encrypted: with the header if present, else headerless (key and IV from the source)
};

struct OpenOptions {
  CipherChoice cipher = CipherChoice::kAuto;
  // Ask a cubetorchfs daemon for a file descriptor when the path is under its mount.
  bool use_daemon = true;
  // Read with O_DIRECT (bypassing the page cache) when the file system allows it.
  bool direct_io = false;
  // Refuse any file that does not carry our integrity tag (plain files, and encrypted files
  // made by other tools or whose tag was stripped from the unauthenticated outer header).
  bool require_integrity = false;
};

// Where the bytes come from, for messages and tests.
enum class Source { kDirect, kDaemonFd, kMount };
const char* SourceName(Source source);

struct ReadOptions {
  int threads = 0;                    // 0: default (CUBE_TORCH_IO_THREADS, else by core count)
  uint64_t chunk_bytes = 8ull << 20;  // unit of work per pread (rounded to the cipher's needs)
};

class ModelFile {
 public:
  static Result<std::unique_ptr<ModelFile>> Open(const std::string& path,
                                                 const OpenOptions& options);
  ~ModelFile();
  ModelFile(const ModelFile&) = delete;
  ModelFile& operator=(const ModelFile&) = delete;

  const Header& header() const { return header_; }
  uint64_t data_size() const { return payload_size_ - header_.data_offset; }
  bool encrypted() const { return encrypted_; }
  // Carries our integrity tag (checked by ReadData; nothing is checked at Open).
  bool has_integrity_tag() const { return integrity_.has_value(); }
  Source source() const { return source_; }
  const std::string& path() const { return path_; }

  // Reads the whole data section into dst[0, data_size()). `dst` is host memory.
  Status ReadData(uint8_t* dst, uint64_t len, const ReadOptions& options);

  // The same, handing each finished range to `sink` (called from the reading threads, ranges
  // in any order) instead of reading into one destination: `stage(offset, len)` returns where
  // the range's bytes go (host memory the caller owns until `sink` returns), `sink(offset,
  // len, ptr)` receives them; with `leave_encrypted` the bytes are handed over
  // still encrypted (the caller decrypts, e.g. on the GPU) — the integrity tag is checked
  // either way. Used by the CUDA copy pipeline.
  using StageFn = std::function<Result<uint8_t*>(uint64_t offset, uint64_t len)>;
  using SinkFn = std::function<Status(uint64_t offset, uint64_t len, uint8_t* ptr)>;
  Status ReadDataStaged(const StageFn& stage, const SinkFn& sink, bool leave_encrypted,
                        const ReadOptions& options);

  // The largest range one read hands to `stage` under `options`.
  uint64_t ItemBytes(const ReadOptions& options) const;

  // Cipher parameters (for a GPU decrypt); only when encrypted().
  const crypto::CipherParams& cipher() const { return *cipher_; }
  // Payload offset of data byte 0 (the CTR keystream offset of the data section).
  uint64_t data_payload_offset() const { return header_.data_offset; }
  // For a plain file without an integrity tag, opened without O_DIRECT: the descriptor
  // (owned by this object) and the file offset of data byte 0, so that a caller may map the
  // data instead of reading it (nothing needs checking or decrypting). -1 otherwise.
  int MappableFd(uint64_t* data_file_offset) const;

 private:
  struct Plan;  // one ReadPlan call's fixed inputs (model_file.cc)

  ModelFile() = default;
  // Open's steps; `path` is the name the caller gave (for messages).
  Status TryDaemon(const std::string& path);
  Status OpenLocal(const std::string& path, bool direct_io);
  Status SetUpCipher(const std::string& path, CipherChoice choice, std::vector<uint8_t>* bounce);
  Status ReadEncryptedHeader(const std::string& path, std::vector<uint8_t>* bounce);
  Status ReadHeader(const std::string& path, std::vector<uint8_t>* bounce);

  Status ReadPlan(const ReadOptions& options, const StageFn& stage, const SinkFn& sink,
                  bool leave_encrypted);
  Status ReadItem(const Plan& plan, uint64_t i, crypto::ChunkMac* mac, std::vector<uint8_t>* bounce,
                  crypto::ChunkTagValue* tag);
  Status PreadFull(uint8_t* dst, uint64_t len, uint64_t file_offset, std::vector<uint8_t>* bounce);

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;  // fd_ was opened with O_DIRECT
  Source source_ = Source::kDirect;
  uint64_t file_size_ = 0;
  uint64_t payload_base_ = 0;  // 0 or kEncryptedHeaderSize
  uint64_t payload_size_ = 0;
  bool encrypted_ = false;
  std::optional<crypto::CipherParams> cipher_;
  std::optional<crypto::IntegrityField> integrity_;
  std::vector<uint8_t> header_ciphertext_;  // payload [0, data_offset) as stored (for the tag)
  Header header_;
};

// Default reader thread count: CUBE_TORCH_IO_THREADS if set (1..256), else
// clamp(2 * hardware threads, 4, 32).
int DefaultIoThreads();

}  // namespace cubetorchfs::loader
