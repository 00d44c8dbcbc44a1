// Work sharing for the native CPU kernels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// fn(task) for every task in [0, n), handed out in order to torch's threads as each becomes free.
// at::parallel_for splits its range into one contiguous chunk per thread, which leaves threads idle
// when tasks differ in size (causal attention rows, sequences of different lengths); list the
// largest tasks first for an even finish.
template <typename F>
void parallel_dynamic(int64_t n, const F& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < n;
           task = next.fetch_add(1, std::memory_order_relaxed))
        fn(task);
  });
}
