// libFuzzer entry point over the safetensors parser: the input is a whole file (8-byte length,
// header, data) and file_size is its size. Any crash, sanitizer report or broken invariant of
// a successful parse is a bug. A successful parse is also written back as a fresh header and
// parsed again: the result must be the same tensors and metadata.
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "loader/safetensors.h"

namespace {

using cubetorchfs::Result;
using cubetorchfs::loader::DtypeName;
using cubetorchfs::loader::Header;
using cubetorchfs::loader::ParseSafetensorsHeader;

void CheckInvariants(const Header& h, size_t size) {
  uint64_t expected = 0;
  for (const auto& t : h.tensors) {
    if (t.begin != expected || t.end < t.begin) std::abort();
    expected = t.end;
  }
  if (h.data_offset != 8 + h.header_len || h.data_offset + expected != size) std::abort();
}

// Writes `h` as a new file (header + zeroed data) and parses it again.
void CheckRoundTrip(const Header& h) {
  nlohmann::json j = nlohmann::json::object();
  if (!h.metadata.empty()) j["__metadata__"] = h.metadata;
  for (const auto& t : h.tensors) {
    j[t.name] = {
        {"dtype", DtypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  const std::string text = j.dump();
  const uint64_t data = h.tensors.empty() ? 0 : h.tensors.back().end;
  if (data > (64u << 20)) return;  // a big (all-empty-claimed) data section: skip the copy
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  file += text;
  file.append(data, '\0');
  Result<Header> again = ParseSafetensorsHeader(reinterpret_cast<const uint8_t*>(file.data()),
                                                file.size(), file.size());
  if (!again.ok() || again->metadata != h.metadata || again->tensors.size() != h.tensors.size()) {
    std::abort();
  }
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto& a = h.tensors[i];
    const auto& b = again->tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin ||
        a.end != b.end) {
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Result<Header> h = ParseSafetensorsHeader(data, size, size);
  if (!h.ok()) return 0;
  CheckInvariants(*h, size);
  CheckRoundTrip(*h);
  return 0;
}
