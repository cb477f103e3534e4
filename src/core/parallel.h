// Splits [0, n) into fixed chunks and runs them on a few threads. Chunk boundaries depend
// only on n and the grain, so per-chunk partial results combine deterministically.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace trainscale::detail {

inline int reference_threads() {
  static const int n = [] {
    unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp(hw, 1u, 64u));
  }();
  return n;
}

inline std::int64_t chunk_count(std::int64_t n, std::int64_t grain) {
  return grain <= 0 ? 1 : (n + grain - 1) / grain;
}

// fn(chunk_index, begin, end) for every chunk of `grain` items.
template <class Fn>
void parallel_chunks(std::int64_t n, std::int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  grain = std::max<std::int64_t>(grain, 1);
  const std::int64_t chunks = chunk_count(n, grain);
  const int threads = static_cast<int>(std::min<std::int64_t>(chunks, reference_threads()));
  auto run = [&](std::int64_t c) { fn(c, c * grain, std::min(n, (c + 1) * grain)); };
  if (threads <= 1) {
    for (std::int64_t c = 0; c < chunks; ++c) run(c);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  auto stride = [&](int t) {
    try {
      for (std::int64_t c = t; c < chunks; c += threads) run(c);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads);
  int started = 0;
  for (; started < threads; ++started) {
    try {
      pool.emplace_back(stride, started);
    } catch (const std::system_error&) {  // no thread to be had (a process limit): the caller runs the rest
      break;
    }
  }
  for (int t = started; t < threads; ++t) stride(t);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// fn(begin, end) over [0, n) in chunks sized so each is worth a thread.
template <class Fn>
void parallel_for(std::int64_t n, std::int64_t grain, Fn&& fn) {
  parallel_chunks(n, grain, [&](std::int64_t, std::int64_t b, std::int64_t e) { fn(b, e); });
}

}  // namespace trainscale::detail
