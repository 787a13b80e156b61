// Parallel memcpy: one large copy, or many copies balanced by bytes.
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace ckpt {
namespace {

constexpr std::size_t kChunkAlign = 4096;  // chunk boundaries on page multiples

// Number of chunks for `total` bytes on up to `threads` threads: one per
// thread, but never less than kMinBytesPerThread per chunk.
std::size_t chunk_count(std::size_t total, unsigned threads) {
    std::size_t by_size = (total + kMinBytesPerThread - 1) / kMinBytesPerThread;
    return std::max<std::size_t>(1, std::min<std::size_t>(threads, by_size));
}

}  // namespace

void parallel_copy(void* dst, const void* src, std::size_t nbytes, unsigned threads) {
    if (nbytes == 0) return;
    threads = resolve_threads(threads);
    std::size_t nchunks = chunk_count(nbytes, threads);
    if (nchunks == 1) {
        std::memcpy(dst, src, nbytes);
        return;
    }
    std::size_t chunk = (nbytes + nchunks - 1) / nchunks;
    chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    nchunks = (nbytes + chunk - 1) / chunk;
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    parallel_for(nchunks, threads, [&](std::size_t i) {
        std::size_t off = i * chunk;
        std::memcpy(d + off, s + off, std::min(chunk, nbytes - off));
    });
}

void copy_many(const std::uintptr_t* dsts, const std::uintptr_t* srcs,
               const std::size_t* sizes, std::size_t count, unsigned threads) {
    // starts[k] = offset of copy k in the concatenation of all copies.
    std::vector<std::size_t> starts(count + 1, 0);
    for (std::size_t k = 0; k < count; ++k) starts[k + 1] = starts[k] + sizes[k];
    std::size_t total = starts[count];
    if (total == 0) return;
    threads = resolve_threads(threads);
    std::size_t nchunks = chunk_count(total, threads);
    // Chunk c covers bytes [c*total/nchunks, (c+1)*total/nchunks) of the
    // concatenation, cutting copies where a boundary falls inside one.
    auto run = [&](std::size_t c) {
        std::size_t lo = total / nchunks * c + std::min(c, total % nchunks);
        std::size_t hi = lo + total / nchunks + (c < total % nchunks ? 1 : 0);
        std::size_t k = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
        for (; k < count && starts[k] < hi; ++k) {
            std::size_t a = std::max(lo, starts[k]), b = std::min(hi, starts[k + 1]);
            if (a >= b) continue;  // zero-sized copy
            std::size_t off = a - starts[k];
            std::memcpy(reinterpret_cast<char*>(dsts[k] + off),
                        reinterpret_cast<const char*>(srcs[k] + off), b - a);
        }
    };
    if (nchunks == 1) run(0);
    else parallel_for(nchunks, threads, run);
}

}  // namespace ckpt
