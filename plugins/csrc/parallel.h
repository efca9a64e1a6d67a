// kiln::parallel_chunks: a parallel loop that a preempted thread does not hold up.
//
// at::parallel_for splits [0, n) into one static range per OpenMP thread, and the region
// ends when the slowest range does. In `kiln serve` the step's threads share their cores with
// the serving threads (the event loop, gRPC, the post thread) and with whatever else runs on
// the host: a thread preempted for 0.3 ms inside a 20 µs region holds up the whole region
// while the others spin at its barrier. Here each thread starts on its own share of small
// chunks (taken from the front of its share through an atomic cursor on its own cache line:
// no contention while nobody steals), and a thread that has finished its share takes chunks
// from the others' shares, so a preempted thread leaves its untouched chunks to the rest.
// Every chunk runs exactly once; which thread runs it varies, so `f` must not depend on that.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kiln {

struct alignas(64) ChunkCursor {
  std::atomic<int64_t> next;
  int64_t end;
};

// f(begin, end) over [0, n) in chunks of `chunk` items (the last may be shorter), on up to
// the engine's OpenMP threads; serially when one thread is enough or inside a parallel region.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t nchunks = (n + chunk - 1) / chunk;
  const int nt = static_cast<int>(std::min<int64_t>(at::get_num_threads(), nchunks));
  if (nt <= 1 || at::in_parallel_region() || omp_in_parallel()) {
    f(0, n);
    return;
  }
  ChunkCursor cursors[64];
  const int teams = std::min(nt, 64);
  for (int t = 0; t < teams; ++t) {
    cursors[t].next.store(nchunks * t / teams, std::memory_order_relaxed);
    cursors[t].end = nchunks * (t + 1) / teams;
  }
#pragma omp parallel num_threads(teams)
  {
    const int me = omp_get_thread_num();
    for (int k = 0; k < teams; ++k) {  // own share first, then the others' from the next one on
      ChunkCursor& c = cursors[(me + k) % teams];
      for (;;) {
        const int64_t i = c.next.fetch_add(1, std::memory_order_relaxed);
        if (i >= c.end) break;
        f(i * chunk, std::min(n, (i + 1) * chunk));
      }
    }
  }
}

// Chunks of about `bytes_per_chunk` for items of `bytes_per_item`, at least `min_chunks_per_thread`
// chunks a thread when the items allow it (room to even out a preempted thread's share).
inline int64_t chunk_items(int64_t n, int64_t bytes_per_item, int64_t bytes_per_chunk,
                           int64_t min_chunks_per_thread = 4) {
  const int64_t by_bytes = std::max<int64_t>(1, bytes_per_chunk / std::max<int64_t>(1, bytes_per_item));
  const int64_t by_count = std::max<int64_t>(
      1, n / (min_chunks_per_thread * std::max<int64_t>(1, at::get_num_threads())));
  return std::min(by_bytes, by_count);
}

}  // namespace kiln
