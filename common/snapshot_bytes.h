// The bytes of the state a process hands the next one (daemon/main.cc's handover): host-order
// 64-bit words and length-prefixed strings, written by one build and read by the next on the
// same host. Every read checks the bytes left, so a truncated or foreign snapshot is refused,
// never read past.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace cubetorchfs {

inline void PutU64(std::string* out, uint64_t v) {
  out->append(reinterpret_cast<const char*>(&v), 8);
}
inline void PutString(std::string* out, const std::string& v) {
  PutU64(out, v.size());
  out->append(v);
}

// Reads what PutU64 and PutString wrote.
class SnapshotReader {
 public:
  explicit SnapshotReader(std::string_view bytes) : rest_(bytes) {}
  bool U64(uint64_t* v) {
    if (rest_.size() < 8) return false;
    std::memcpy(v, rest_.data(), 8);
    rest_.remove_prefix(8);
    return true;
  }
  bool String(std::string* v) {
    uint64_t n = 0;
    if (!U64(&n) || n > rest_.size()) return false;
    v->assign(rest_.substr(0, n));
    rest_.remove_prefix(n);
    return true;
  }
  // The next `n` bytes, as they are.
  bool Bytes(uint64_t n, std::string_view* v) {
    if (n > rest_.size()) return false;
    *v = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return true;
  }
  bool done() const { return rest_.empty(); }
  std::string_view rest() const { return rest_; }

 private:
  std::string_view rest_;
};

}  // namespace cubetorchfs
