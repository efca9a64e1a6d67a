// Far software prefetch for the decode kernels that stream weights (quant plugin: int8 dot
// blocks, W4A8 / int4 blocks, the float-decoder GEMV).
//
// The kernels ask for each weight line a second time, kFarBytes ahead of its use, into L2
// only (prefetcht2). An L1 prefetch or load miss holds one of the core's few fill buffers
// until its line arrives, which caps the lines in flight from DRAM and so one core's read
// rate; the far request starts the line's trip early and the near access then finds it in
// L2. Measured on an Intel Xeon (AMX, 2 vCPUs, 2 threads) with the weights out of cache,
// plan steps at batch 1 right after a 1 GiB read (median of 5 steps, alternating
// processes): int8 7.21 -> 6.47 and 7.38 -> 6.64 ms (two series), W4A8 (throughput) 3.71 ->
// 3.33, fp32 (519 MiB: never in cache) 28.0 -> 24.5, and with the steps back to back fp32
// 26.8 -> 22.8 while int8 and W4A8, whose weights then sit in that Xeon's 480 MiB L3, moved
// within noise (4.19 / 4.32 -> 4.36 / 4.36, 2.49 -> 2.51). SmolLM2's lm_head alone (int8,
// 28 MB) 18.6 -> 20.6 GB/s against torch.sum's 22-24. 32 and 128 KiB ahead gained less or
// the same. A prefetch never faults, so one past the end of the weights is harmless.
#pragma once

#include <cstdint>
#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace kiln {

constexpr int64_t kFarBytes = 65536;

// The line kFarBytes past p, into L2.
inline void prefetch_far(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p) + kFarBytes, _MM_HINT_T2);
#else
  __builtin_prefetch(static_cast<const char*>(p) + kFarBytes, 0, 1);
#endif
}

}  // namespace kiln
