/* libcubetorch_io: the C ABI of the cubetorchfs model loader, used by the cube_torch Python
 * package through ctypes (so the package does not depend on the torch version: Python
 * allocates the destination tensor, the library fills it).
 *
 * Every function that can fail returns 0 or a negative errno value (-ENOENT no such file,
 * -EINVAL bad input, -EBADMSG a file that breaks a safetensors rule or corrupt or tampered
 * data, -ENOTSUP not built with CUDA, -EIO anything else) and writes a message naming the file
 * and the problem into err[0, err_len). Keys never appear in messages.
 *
 * Thread safety: different handles may be used from different threads; one handle by one
 * caller at a time. */
#ifndef CUBETORCH_IO_H_
#define CUBETORCH_IO_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CTIO_ABI_VERSION 2

/* ctio_open flags */
#define CTIO_NO_DAEMON 1         /* do not ask a cubetorchfs daemon for a descriptor */
#define CTIO_DIRECT_IO 2         /* read with O_DIRECT where the file system allows it */
#define CTIO_REQUIRE_INTEGRITY 4 /* refuse files without our integrity tag */

typedef struct ctio_file ctio_file;
typedef struct ctio_helper ctio_helper;

int ctio_abi_version(void);
/* 1 when built with the CUDA runtime and kernel. */
int ctio_cuda_built(void);

/* The reader threads used when a call passes threads = 0 (CUBE_TORCH_IO_THREADS, else twice
 * the cores, 4 to 32). */
int ctio_default_threads(void);

/* Opens a safetensors file. cipher: -1 auto (encrypted iff it has the encrypted header),
 * 0 plain, 1 encrypted (header or headerless). */
int ctio_open(const char* path, int cipher, int flags, ctio_file** out, char* err, size_t err_len);

/* The validated header as JSON, valid until ctio_close:
 * {"data_size": n, "encrypted": bool, "integrity_tag": bool (carries our tag, checked when the data
 * is read), "source": "direct|daemon-fd|mount", "metadata": {str: str}, "tensors": [{"name",
 * "dtype", "shape", "begin", "end"}, ...]} with tensors in file order and begin/end relative to the
 * data section. */
const char* ctio_info_json(ctio_file* f);
uint64_t ctio_data_size(ctio_file* f);

/* For a plain file without an integrity tag, opened without CTIO_DIRECT_IO: the descriptor the
 * library reads from (owned by f, valid until ctio_close) and, in *data_file_offset, the file
 * offset of data byte 0, so that the caller may map the data instead of reading it. -1 for any
 * other file (encrypted, tagged, O_DIRECT): those must go through ctio_read. */
int ctio_mappable_fd(ctio_file* f, uint64_t* data_file_offset);

/* Reads the data section (len must be ctio_data_size) into host memory, decrypting and
 * checking the integrity tag. threads 0: default. */
int ctio_read(ctio_file* f, void* dst, uint64_t len, int threads, char* err, size_t err_len);

/* The same into device memory of CUDA device `device`, through the helper's pinned staging
 * slots (helper may be NULL: temporary ones). gpu_decrypt: decrypt on the device. */
int ctio_read_cuda(ctio_file* f, void* device_dst, uint64_t len, int device, int threads,
                   ctio_helper* helper, int gpu_decrypt, char* err, size_t err_len);

void ctio_close(ctio_file* f);

/* Reusable pinned staging slots for ctio_read_cuda: `slots` buffers of `slot_bytes` (0:
 * 16 MiB; slots 0: one more than the cores, 4 to 17). -ENOTSUP without CUDA. A file read in
 * units larger than the slots (its integrity chunk) gets temporary slots that fit. */
int ctio_helper_new(uint64_t slot_bytes, int slots, ctio_helper** out, char* err, size_t err_len);
void ctio_helper_free(ctio_helper* h);

typedef struct {
  const char* name;
  const char* dtype;     /* "F32", "BF16", ... */
  const uint64_t* shape; /* ndim values */
  int ndim;
  const void* data; /* contiguous little-endian bytes */
  uint64_t len;
} ctio_tensor;

/* Writes a safetensors file (atomically: temporary file, fsync, rename). metadata_json: a
 * JSON object of strings, or NULL. encrypt: veTurboIO header format with a fresh IV and our
 * integrity tag, key from DATAPIPE_SOCKET_PATH or VETURBOIO_KEY. */
int ctio_save(const char* path, const ctio_tensor* tensors, int count, const char* metadata_json,
              int encrypt, int threads, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* CUBETORCH_IO_H_ */
