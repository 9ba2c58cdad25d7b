// libFuzzer entry point over the loader's file-opening code: the encrypted-header parser and
// its integrity field, and ModelFile::Open + ReadData over a whole (plain or encrypted) file.
// Inputs starting with 'E' are an encrypted header's JSON area (after the 16-byte magic,
// zero-padded to 256 KiB), optionally followed, after a 0xFF byte, by a payload that is
// loaded as an encrypted file; other inputs are loaded as plain files. Any crash or sanitizer
// report is a bug; a load that succeeds must have read exactly data_size() bytes.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "crypto/encrypted_header.h"
#include "crypto/integrity.h"
#include "loader/model_file.h"

namespace {

using cubetorchfs::loader::ModelFile;

void LoadFromMemory(const std::string& bytes) {
  int fd = static_cast<int>(::memfd_create("fuzz", MFD_CLOEXEC));
  if (fd < 0) std::abort();
  if (!bytes.empty() &&
      ::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size()))
    std::abort();
  cubetorchfs::loader::OpenOptions o;
  o.use_daemon = false;
  auto f = ModelFile::Open("/proc/self/fd/" + std::to_string(fd), o);
  if (f.ok()) {
    const uint64_t n = (*f)->data_size();
    if (n <= (1u << 20)) {
      std::vector<uint8_t> out(n);
      cubetorchfs::loader::ReadOptions ro;
      ro.threads = 2;
      (void)(*f)->ReadData(out.data(), out.size(), ro);
    }
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ::setenv("VETURBOIO_KEY", "MDEyMzQ1Njc4OWFiY2RlZg==", 1);  // so encrypted inputs decrypt
  ::unsetenv("DATAPIPE_SOCKET_PATH");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 0 && data[0] == 'E') {
    const uint8_t* end = static_cast<const uint8_t*>(std::memchr(data + 1, 0xFF, size - 1));
    const size_t json_len = (end ? static_cast<size_t>(end - data) : size) - 1;
    std::string file(cubetorchfs::crypto::kEncryptedHeaderSize, '\0');
    std::memcpy(file.data(), cubetorchfs::crypto::kEncryptedHeaderMagic.data(), 16);
    std::memcpy(file.data() + 16, data + 1, std::min(json_len, file.size() - 16));
    auto h = cubetorchfs::crypto::ParseEncryptedHeader(
        reinterpret_cast<const uint8_t*>(file.data()), file.size());
    if (h.ok()) (void)cubetorchfs::crypto::GetIntegrityField(*h);
    if (end != nullptr) {
      file.append(reinterpret_cast<const char*>(end + 1),
                  size - static_cast<size_t>(end + 1 - data));
      LoadFromMemory(file);
    }
    return 0;
  }
  LoadFromMemory(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
