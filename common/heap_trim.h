// Giving freed heap back to the system. glibc keeps what the daemon frees in its arenas
// (only the top of the main heap is returned on its own), so after a burst (a large request,
// a stream of many queued paths deleted or expired) RSS would stay at the burst's peak until
// the memory is reused. malloc_trim(0) returns every free page of every arena.
//
// Thread safety: safe from any thread.
#pragma once

namespace cubetorchfs {

// malloc_trim(0), unless it ran in the last half second anywhere in the process (it walks
// every arena: not for hot paths). True if it ran now; false if it was skipped, in which case
// a caller with much to give back should try again later.
bool TrimHeap();

}  // namespace cubetorchfs
