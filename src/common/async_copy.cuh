// cp.async (sm_80+): 16-byte copies from global to shared memory that need no registers for
// the data, so a thread can keep the next tile's reads in flight while it works on this one.
// A thread's copies become visible to that thread at cp_async_wait; other threads also need a
// barrier after it.
#pragma once

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

}  // namespace trainscale::detail
