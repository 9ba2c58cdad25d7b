// The parts of the kernel's FUSE protocol newer than the kernel headers Debian 12 ships
// (<linux/fuse.h> 7.38): FUSE over io_uring (7.42, Linux 6.14) and passthrough (7.40,
// Linux 6.9). Values from the kernel's include/uapi/linux/fuse.h; sizes are checked below.
#pragma once

#include <linux/ioctl.h>

#include <cstdint>

namespace cubetorchfs::fuse::abi {

// FUSE_INIT flags (the 64-bit set; bits 32 and up travel in flags2).
constexpr uint64_t kInitExt = 1ull << 30;      // FUSE_INIT_EXT: flags2 is valid
constexpr uint64_t kPassthrough = 1ull << 37;  // FUSE_PASSTHROUGH
constexpr uint64_t kOverIoUring = 1ull << 41;  // FUSE_OVER_IO_URING

// Offsets in the INIT request after its fuse_in_header (struct fuse_init_in) and in the
// reply after its fuse_out_header (struct fuse_init_out).
constexpr size_t kInitInFlags = 12, kInitInFlags2 = 16, kInitInMinSize = 64;
constexpr size_t kInitOutFlags = 12, kInitOutFlags2 = 32, kInitOutMaxStackDepth = 36,
                 kInitOutSize = 64;

// Passthrough: registering a backing file on the connection's device, and the open reply that
// names it (struct fuse_open_out: fh, open_flags, backing_id).
struct BackingMap {  // struct fuse_backing_map
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
constexpr unsigned long kDevIocBackingOpen = _IOW(229, 1, BackingMap);  // FUSE_DEV_IOC_BACKING_OPEN
constexpr unsigned long kDevIocBackingClose = _IOW(229, 2, uint32_t);  // FUSE_DEV_IOC_BACKING_CLOSE
constexpr uint32_t kFopenPassthrough = 1u << 7;                        // FOPEN_PASSTHROUGH
constexpr size_t kOpenOutFlags = 8, kOpenOutBackingId = 12, kOpenOutSize = 16;
// The depth of file systems stacked under this one: 1, a backing file on a plain file system.
constexpr uint32_t kPassthroughStackDepth = 1;

// FUSE over io_uring: the uring_cmd operations on a /dev/fuse descriptor.
constexpr uint32_t kUringCmdRegister = 1;        // FUSE_IO_URING_CMD_REGISTER
constexpr uint32_t kUringCmdCommitAndFetch = 2;  // FUSE_IO_URING_CMD_COMMIT_AND_FETCH

// struct fuse_uring_ent_in_out
struct UringEntInOut {
  uint64_t flags;
  uint64_t commit_id;   // the request's unique, given back at commit
  uint32_t payload_sz;  // bytes of arguments in the payload buffer (both ways)
  uint32_t padding;
  uint64_t reserved;
};

// struct fuse_uring_req_header: the first of an entry's two buffers.
struct UringReqHeader {
  char in_out[128];  // fuse_in_header of a request; the fuse_out_header of its reply
  char op_in[128];   // the request's first argument (its per-operation header)
  UringEntInOut ring_ent_in_out;
};

// struct fuse_uring_cmd_req: the command's data, in the 128-byte SQE's extra 80 bytes.
struct UringCmdReq {
  uint64_t flags;
  uint64_t commit_id;
  uint16_t qid;
  uint8_t padding[6];
};

static_assert(sizeof(UringEntInOut) == 32);
static_assert(sizeof(UringReqHeader) == 288);
static_assert(sizeof(UringCmdReq) == 24);
static_assert(sizeof(BackingMap) == 16);

}  // namespace cubetorchfs::fuse::abi
