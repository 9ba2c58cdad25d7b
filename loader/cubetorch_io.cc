// The C ABI of libcubetorch_io (cubetorch_io.h) over ModelFile, LoadToDevice and
// SaveSafetensors. Nothing here throws across the boundary.
#include "loader/cubetorch_io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cuda/aes_ctr_gpu.h"
#include "cuda/h2d.h"
#include "loader/device_load.h"
#include "loader/model_file.h"
#include "loader/model_writer.h"

using cubetorchfs::Result;
using cubetorchfs::Status;
namespace loader = cubetorchfs::loader;
namespace cuda = cubetorchfs::cuda;

struct ctio_file {
  std::unique_ptr<loader::ModelFile> file;
  std::string info;
};

struct ctio_helper {
  std::vector<uint8_t*> slots;
  uint64_t slot_bytes = 0;
  ~ctio_helper() {
    for (uint8_t* p : slots) cuda::FreePinned(p);
  }
};

namespace {

int Fail(const Status& s, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    std::string msg = s.message().empty() ? s.ToString() : s.message();
    std::snprintf(err, err_len, "%s", msg.c_str());
  }
  return -ToErrno(s);
}

// Runs fn, turning exceptions (bad_alloc, JSON errors) into -EIO/-EINVAL with a message.
template <typename Fn>
int Guard(char* err, size_t err_len, Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return Fail(Status::IOError("out of memory"), err, err_len);
  } catch (const std::exception& e) {
    return Fail(Status::InvalidArgument(e.what()), err, err_len);
  }
}

std::string InfoJson(const loader::ModelFile& f) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const loader::TensorInfo& t : f.header().tensors)
    tensors.push_back({{"name", t.name},
                       {"dtype", loader::DtypeName(t.dtype)},
                       {"shape", t.shape},
                       {"begin", t.begin},
                       {"end", t.end}});
  nlohmann::json j = {{"data_size", f.data_size()},
                      {"encrypted", f.encrypted()},
                      {"integrity_tag", f.has_integrity_tag()},
                      {"source", loader::SourceName(f.source())},
                      {"metadata", f.header().metadata},
                      {"tensors", tensors}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

int ctio_abi_version(void) { return CTIO_ABI_VERSION; }

int ctio_cuda_built(void) { return cuda::CudaRuntimeBuilt() && cuda::AesCtrGpuBuilt() ? 1 : 0; }

int ctio_default_threads(void) { return loader::DefaultIoThreads(); }

int ctio_open(const char* path, int cipher, int flags, ctio_file** out, char* err, size_t err_len) {
  return Guard(err, err_len, [&] {
    if (path == nullptr || out == nullptr)
      return Fail(Status::InvalidArgument("ctio_open: null argument"), err, err_len);
    loader::OpenOptions o;
    o.cipher = cipher < 0    ? loader::CipherChoice::kAuto
               : cipher == 0 ? loader::CipherChoice::kOff
                             : loader::CipherChoice::kOn;
    o.use_daemon = (flags & CTIO_NO_DAEMON) == 0;
    o.direct_io = (flags & CTIO_DIRECT_IO) != 0;
    o.require_integrity = (flags & CTIO_REQUIRE_INTEGRITY) != 0;
    Result<std::unique_ptr<loader::ModelFile>> f = loader::ModelFile::Open(path, o);
    if (!f.ok()) return Fail(f.status(), err, err_len);
    auto h = std::make_unique<ctio_file>();
    h->file = std::move(f.value());
    h->info = InfoJson(*h->file);
    *out = h.release();
    return 0;
  });
}

const char* ctio_info_json(ctio_file* f) { return f == nullptr ? "{}" : f->info.c_str(); }

uint64_t ctio_data_size(ctio_file* f) { return f == nullptr ? 0 : f->file->data_size(); }

int ctio_mappable_fd(ctio_file* f, uint64_t* data_file_offset) {
  return f == nullptr ? -1 : f->file->MappableFd(data_file_offset);
}

int ctio_read(ctio_file* f, void* dst, uint64_t len, int threads, char* err, size_t err_len) {
  return Guard(err, err_len, [&] {
    if (f == nullptr || (dst == nullptr && len > 0))
      return Fail(Status::InvalidArgument("ctio_read: null argument"), err, err_len);
    loader::ReadOptions ro;
    ro.threads = threads;
    return Fail(f->file->ReadData(static_cast<uint8_t*>(dst), len, ro), err, err_len);
  });
}

int ctio_read_cuda(ctio_file* f, void* device_dst, uint64_t len, int device, int threads,
                   ctio_helper* helper, int gpu_decrypt, char* err, size_t err_len) {
  return Guard(err, err_len, [&] {
    if (f == nullptr || (device_dst == nullptr && len > 0))
      return Fail(Status::InvalidArgument("ctio_read_cuda: null argument"), err, err_len);
    if (len != f->file->data_size())
      return Fail(Status::InvalidArgument("ctio_read_cuda: destination of " + std::to_string(len) +
                                          " bytes for a data section of " +
                                          std::to_string(f->file->data_size())),
                  err, err_len);
    // A file read in units larger than the helper's slots (an integrity chunk size above the
    // slot size) gets temporary slots that fit, rather than an error: the helper cannot know
    // every file it will serve.
    loader::ReadOptions unit_of;
    unit_of.chunk_bytes = helper != nullptr ? helper->slot_bytes : 16ull << 20;
    const uint64_t unit = f->file->ItemBytes(unit_of);
    std::unique_ptr<ctio_helper> temp;
    if (helper == nullptr || unit > helper->slot_bytes) {
      const uint64_t slot_bytes =
          std::max<uint64_t>(16ull << 20, (unit + (1u << 20) - 1) >> 20 << 20);
      ctio_helper* made = nullptr;
      // Slots larger than the default come 3 at a time (two being filled, one being copied):
      // the file's header sets their size, and pinned memory is scarce.
      int rc = ctio_helper_new(slot_bytes, slot_bytes > (16ull << 20) ? 3 : 0, &made, err, err_len);
      if (rc != 0) return rc;
      temp.reset(made);
      helper = made;
    }
    Result<std::unique_ptr<cuda::Copier>> copier =
        cuda::NewCopier(device, static_cast<int>(helper->slots.size()));
    if (!copier.ok()) return Fail(copier.status(), err, err_len);
    loader::DeviceLoadOptions o;
    o.threads = threads;
    o.gpu_decrypt = gpu_decrypt != 0 && cuda::AesCtrGpuBuilt();
    return Fail(
        loader::LoadToDevice(*f->file, **copier, helper->slots, helper->slot_bytes, device_dst, o),
        err, err_len);
  });
}

void ctio_close(ctio_file* f) { delete f; }

int ctio_helper_new(uint64_t slot_bytes, int slots, ctio_helper** out, char* err, size_t err_len) {
  return Guard(err, err_len, [&] {
    if (out == nullptr)
      return Fail(Status::InvalidArgument("ctio_helper_new: null argument"), err, err_len);
    if (slot_bytes == 0) slot_bytes = 16ull << 20;
    // One slot more than cores: the reading threads (at most slots - 1) fill slots from the
    // page cache while one is copied. On a 16-core H100 host, 4 GiB hot went from 28.6 GB/s
    // with 8 slots to 36.1 with 17; more gained nothing (bench/README.md, gpu_bench).
    if (slots <= 0)
      slots = std::clamp(static_cast<int>(std::thread::hardware_concurrency()) + 1, 4, 17);
    if (slots < 2 || slots > 1024 || slot_bytes < (1u << 20) || slot_bytes > (1ull << 32))
      return Fail(Status::InvalidArgument("ctio_helper_new: want 2..1024 slots of 1 MiB..4 GiB"),
                  err, err_len);
    auto h = std::make_unique<ctio_helper>();
    h->slot_bytes = slot_bytes;
    for (int i = 0; i < slots; ++i) {
      Result<void*> p = cuda::AllocPinned(slot_bytes);
      if (!p.ok()) return Fail(p.status(), err, err_len);
      h->slots.push_back(static_cast<uint8_t*>(*p));
    }
    *out = h.release();
    return 0;
  });
}

void ctio_helper_free(ctio_helper* h) { delete h; }

int ctio_save(const char* path, const ctio_tensor* tensors, int count, const char* metadata_json,
              int encrypt, int threads, char* err, size_t err_len) {
  return Guard(err, err_len, [&] {
    if (path == nullptr || (tensors == nullptr && count > 0) || count < 0)
      return Fail(Status::InvalidArgument("ctio_save: null argument"), err, err_len);
    std::vector<loader::SaveTensor> ts;
    ts.reserve(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) {
      const ctio_tensor& c = tensors[i];
      if (c.name == nullptr || c.dtype == nullptr || (c.ndim > 0 && c.shape == nullptr) ||
          c.ndim < 0)
        return Fail(
            Status::InvalidArgument("ctio_save: tensor " + std::to_string(i) + ": null field"), err,
            err_len);
      Result<loader::Dtype> d = loader::ParseDtype(c.dtype);
      if (!d.ok())
        return Fail(Status::InvalidArgument(std::string("tensor '") + c.name + "': unknown dtype " +
                                            c.dtype),
                    err, err_len);
      loader::SaveTensor t;
      t.name = c.name;
      t.dtype = *d;
      t.shape.assign(c.shape, c.shape + c.ndim);
      t.data = static_cast<const uint8_t*>(c.data);
      t.len = c.len;
      ts.push_back(std::move(t));
    }
    std::map<std::string, std::string> metadata;
    if (metadata_json != nullptr && *metadata_json != '\0') {
      nlohmann::json m = nlohmann::json::parse(metadata_json, nullptr, false);
      if (m.is_discarded() || !m.is_object())
        return Fail(Status::InvalidArgument("metadata must be a JSON object of strings"), err,
                    err_len);
      for (auto& [k, v] : m.items()) {
        if (!v.is_string())
          return Fail(Status::InvalidArgument("metadata '" + k + "' is not a string"), err,
                      err_len);
        metadata[k] = v.get<std::string>();
      }
    }
    loader::SaveOptions o;
    o.encrypt = encrypt != 0;
    o.threads = threads;
    return Fail(loader::SaveSafetensors(path, ts, metadata, o), err, err_len);
  });
}

}  // extern "C"
#pragma GCC visibility pop
