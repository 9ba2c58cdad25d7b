#include "loader/device_load.h"

#include <deque>

#include "common/thread_annotations.h"

namespace cubetorchfs::loader {

Status LoadToDevice(ModelFile& file, cuda::Copier& copier, const std::vector<uint8_t*>& slots,
                    uint64_t slot_bytes, void* device_dst, const DeviceLoadOptions& options) {
  if (slots.size() < 2)
    return Status::InvalidArgument("device load: need at least 2 staging slots");
  ReadOptions ro;
  ro.threads = options.threads;
  ro.chunk_bytes = slot_bytes;
  if (file.ItemBytes(ro) > slot_bytes)
    return Status::InvalidArgument("device load: staging slots of " + std::to_string(slot_bytes) +
                                   " bytes are smaller than the file's " +
                                   std::to_string(file.ItemBytes(ro)) + "-byte read unit");
  // Never more readers than slots minus one, so the copy of one slot overlaps the reads.
  const int max_threads = static_cast<int>(slots.size()) - 1;
  const int wanted = ro.threads > 0 ? ro.threads : DefaultIoThreads();
  ro.threads = std::min(wanted, max_threads);

  Mutex mu;
  std::deque<int> free_slots, in_flight;
  for (int i = 0; i < static_cast<int>(slots.size()); ++i) free_slots.push_back(i);
  auto slot_of = [&](uint8_t* p) {
    for (size_t i = 0; i < slots.size(); ++i)
      if (slots[i] == p) return static_cast<int>(i);
    return -1;
  };
  auto stage = [&](uint64_t, uint64_t) -> Result<uint8_t*> {
    int slot;
    bool wait = false;
    {
      MutexLock lock(mu);
      if (!free_slots.empty()) {
        slot = free_slots.front();
        free_slots.pop_front();
      } else if (!in_flight.empty()) {
        slot = in_flight.front();  // the oldest copy: most likely done
        in_flight.pop_front();
        wait = true;
      } else {
        return Status::IOError("device load: no staging slot (internal error)");
      }
    }
    if (wait) CTFS_RETURN_IF_ERROR(copier.WaitSlot(slot));
    return slots[static_cast<size_t>(slot)];
  };
  auto sink = [&](uint64_t offset, uint64_t len, uint8_t* ptr) -> Status {
    const int slot = slot_of(ptr);
    if (slot < 0) return Status::IOError("device load: unknown staging slot (internal error)");
    CTFS_RETURN_IF_ERROR(
        copier.CopyAsync(static_cast<uint8_t*>(device_dst) + offset, ptr, len, slot));
    MutexLock lock(mu);
    in_flight.push_back(slot);
    return Status::OK();
  };
  const bool gpu_decrypt = options.gpu_decrypt && file.encrypted();
  Status s = file.ReadDataStaged(stage, sink, gpu_decrypt, ro);
  Status synced = copier.Sync();  // even on error: no copy may still read the slots
  CTFS_RETURN_IF_ERROR(s);
  CTFS_RETURN_IF_ERROR(synced);
  if (gpu_decrypt && file.data_size() > 0) {
    const crypto::CipherParams& c = file.cipher();
    CTFS_RETURN_IF_ERROR(copier.DecryptOnDevice(c.key.data(), c.key.size(), c.iv.data(),
                                                file.data_payload_offset(), device_dst,
                                                file.data_size()));
  }
  return Status::OK();
}

}  // namespace cubetorchfs::loader
