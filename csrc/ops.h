// ckptstore native kernels: plain C++17 on raw pointers, no Python, no torch.
// module.cpp binds them as ckptstore._C; everything here runs without the GIL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace ckpt {

// Hardware threads this process may use (Linux: its CPU affinity mask; else
// std::thread::hardware_concurrency), at least 1; computed once.
unsigned hardware_threads();

// Threads a call may use: `requested` (0 = default) clamped to [1, pool size + 1].
unsigned resolve_threads(unsigned requested);

// Runs task(i) for every i in [0, ntasks) on at most `threads` threads of a
// persistent pool; the calling thread takes part and returns when all are done.
void parallel_for(std::size_t ntasks, unsigned threads,
                  const std::function<void(std::size_t)>& task);

// memcpy of nbytes, split in chunks of >= kMinBytesPerThread over the pool.
void parallel_copy(void* dst, const void* src, std::size_t nbytes, unsigned threads);

// count copies dst[k] <- src[k] of size[k] bytes, balanced over the pool by bytes.
void copy_many(const std::uintptr_t* dsts, const std::uintptr_t* srcs,
               const std::size_t* sizes, std::size_t count, unsigned threads);

// blosc byte-plane shuffle: n = nbytes / itemsize elements, dst[j*n + i] =
// src[i*itemsize + j]; the nbytes % itemsize trailing bytes are copied as is.
void shuffle(std::uint8_t* dst, const std::uint8_t* src, std::size_t nbytes,
             std::size_t itemsize);
// Exact inverse of shuffle.
void unshuffle(std::uint8_t* dst, const std::uint8_t* src, std::size_t nbytes,
               std::size_t itemsize);

// Below this many bytes per thread, a copy uses fewer threads (1 MiB).
constexpr std::size_t kMinBytesPerThread = std::size_t(1) << 20;
// Default thread count cap: memory bandwidth saturates well before this.
constexpr unsigned kMaxDefaultThreads = 16;

}  // namespace ckpt
