// CRC32C (Castagnoli), as stored with every NVMe-tier chunk. Hardware instructions where the
// CPU has them (SSE4.2), a table otherwise; both give the same values.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cubetorchfs::cache {

uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace cubetorchfs::cache
