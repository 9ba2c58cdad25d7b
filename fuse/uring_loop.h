// FUSE over io_uring (Linux 6.14+): the kernel hands requests to per-CPU queues of entries
// the daemon registered, each a pair of buffers, and takes the reply and the next request in
// one io_uring command (COMMIT_AND_FETCH) instead of a read() and a writev() on /dev/fuse.
//
// Threads: each serves one entry of one queue through an io_uring of its own, pinned to that
// queue's CPU. A thread busy with a request (a miss waits on the store) holds its entry, so the
// kernel gives the queue's next request to another entry: a queue starts with min_per_queue
// threads and grows to max_per_queue while all of its threads are busy.
//
// Requests arrive as the kernel's fuse_in_header in the header buffer, the first argument in
// op_in and the rest in the payload. The entry's memory is laid out so that header and first
// argument are copied (at most 168 bytes) in front of the payload, and libfuse gets the
// request whole without a copy of its payload. libfuse's reply (session.cc's writev hook) is
// copied into the entry's buffers and committed when the handler returns. FORGET, INTERRUPT
// and notifications still travel through /dev/fuse (the kernel's design), served by the
// session loop beside this one.
//
// The connection stays on io_uring once the kernel has seen a queue of every CPU registered.
// The kernel holds a request it gave an entry until a COMMIT_AND_FETCH names it, from any
// process, and reads the reply from the entry's buffers at the addresses registered, in the
// committing process. So the entries live in a memfd (UringSlots) the supervisor keeps and
// every process maps at the same address: after a crash or an upgrade, the next process finds
// in it the requests the last one had taken or been given and not answered, answers them and
// commits them, which adopts the entry (docs/operations.md).
//
// Thread safety: Start once; Stop from any thread; Join once.
#pragma once

#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace cubetorchfs::fuse {

// The entries' memory: a table of slot states, then each slot's header page and payload,
// in a memfd mapped at one fixed address in every process that serves the connection.
class UringSlots {
 public:
  // Maps the memfd `fd` of an earlier process (adopting its slots) or, with `fd` < 0, a new
  // one of `slots` slots for payloads of `payload_size`. The descriptor is kept (fd()).
  // IOError: the memfd is not one of ours, or its address is taken in this process.
  static Result<std::shared_ptr<UringSlots>> Open(int fd, int slots, size_t payload_size);
  ~UringSlots();
  UringSlots(const UringSlots&) = delete;
  UringSlots& operator=(const UringSlots&) = delete;

  int fd() const { return fd_; }
  bool adopted() const { return adopted_; }
  int count() const;
  size_t payload_size() const;
  struct Table;
  Table* table() const { return table_; }
  char* slot(int i) const;

 private:
  UringSlots() = default;
  int fd_ = -1;
  bool adopted_ = false;
  void* base_ = nullptr;
  Table* table_ = nullptr;
};

struct UringLoopOptions {
  int fuse_fd = -1;  // this process's descriptor of the connection
  int min_per_queue = 1;
  int max_per_queue = 32;
  // Statfs on this path from each queue's CPU once the queues are registered, so that
  // requests the kernel queued while no entry was registered (after a crash of the process
  // before) are fetched without waiting for more traffic. Empty: none.
  std::string kick_path;
  // The entries' memory (required); an adopted one's unanswered requests are served first.
  std::shared_ptr<UringSlots> slots;
};

// What the last Start found in adopted slots (docs/operations.md).
struct UringAdoption {
  int served = 0;     // requests given to the process before and never taken: served now
  int retried = 0;    // taken and not answered, safe to redo (reads, lookups): served again
  int aborted = 0;    // taken and not answered, changes (write, unlink...): ECONNABORTED
  int committed = 0;  // answered and not yet committed: committed now
  int slots = 0;      // slots of the processes before taken up
};

// The queues the kernel keeps: one for each possible CPU (/sys/devices/system/cpu/possible).
int UringQueueCount();

// Whether this process may create the io_uring an entry needs (kernel.io_uring_disabled, a
// seccomp filter, an old kernel).
Status CanUseIoUring();

// Makes the kernel send the connection's requests by /dev/fuse again, where FUSE_INIT took
// io_uring but no queue can be served: without it, they would wait for entries forever.
void ResetToDevFuse(int fuse_fd);

// What every entry of a registered reply is: where libfuse's reply to the request a thread is
// serving goes (session.cc's writev hook). Null when the thread serves no io_uring request.
struct UringReply;
UringReply* CurrentUringReply();
// Copies a reply (fuse_out_header first) into the current entry: false if it does not fit or
// is not for the request the entry holds (the caller then writes it to /dev/fuse).
bool StoreUringReply(UringReply* r, const struct iovec* iov, int count);

class UringLoop {
 public:
  // Answers and adopts what the slots hold from an earlier process, registers min_per_queue
  // entries on every queue and starts their threads. An error means an adoption or a queue's
  // first registration failed: the kernel has then been told to send requests by /dev/fuse,
  // which it does unless it already used the ring (a connection served over io_uring before).
  static Result<std::unique_ptr<UringLoop>> Start(fuse_session* se, const UringLoopOptions& o);
  ~UringLoop();

  // Asks every thread to stop after its current request; Join waits for them. A thread also
  // stops when the connection ends (unmount): then the session is made to exit.
  void Stop();
  // For a handover: every thread answers what it is serving, then stops as soon as its entry
  // is given a request (left in the slot for the next process) or after `wait_ms`.
  void Drain(int wait_ms);
  void Join();
  int threads() const;
  UringAdoption adoption() const;

  struct Shared;

 private:
  explicit UringLoop(std::shared_ptr<Shared> shared);
  std::shared_ptr<Shared> shared_;
};

}  // namespace cubetorchfs::fuse
