// cp.async (sm_80+): 16-byte copies from global to shared memory that need no registers for
// the data, so a thread can keep the next tile's reads in flight while it works on this one.
// A thread's copies become visible to that thread at cp_async_wait; other threads also need a
// barrier after it. And the sm_90 bulk copy: one instruction moves a whole range, whose arrival
// every thread waits for on a shared mbarrier.
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace trainscale::detail {

// Through L2 only (.cg): the data is read once from shared memory, not again from L1.
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
}

// cp_async_16 that writes 16 zero bytes instead, reading nothing, when !valid (the rows of a
// tile past the end of a tensor); global_src must still be a valid address.
__device__ __forceinline__ void cp_async_16_zfill(void* shared_dst, const void* global_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global_src), "r"(src_bytes)
               : "memory");
}

// One 4-byte word the same way (.ca: .cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async_4_zfill(void* shared_dst, const void* global_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(global_src), "r"(src_bytes)
               : "memory");
}

// Closes the thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most kPending of the thread's most recent groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// sm_90: one bulk copy (the copy engine, one instruction for the whole range) of `bytes` from
// global to shared memory, both 16-byte aligned and `bytes` a multiple of 16. It completes
// `bytes` transactions on the shared mbarrier `landed`, so the issuing thread first arms it:
// arrive_expect_tx below, then this copy.
__device__ __forceinline__ void bulk_copy_to_shared(void* shared_dst, const void* global_src,
                                                    std::uint32_t bytes, std::uint64_t* landed) {
  cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, shared_dst,
                           global_src, bytes, landed);
}

// Arms `landed` for one arrival and `bytes` transactions (the bulk copies about to be issued).
__device__ __forceinline__ void arrive_expect_tx(std::uint64_t* landed, std::uint32_t bytes) {
  cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                       cuda::ptx::space_shared, landed, bytes);
}

// Waits until the phase of `landed` with this parity has completed.
__device__ __forceinline__ void wait_parity(std::uint64_t* landed, std::uint32_t parity) {
  while (!cuda::ptx::mbarrier_try_wait_parity(landed, parity)) {
  }
}

}  // namespace trainscale::detail
