// Parallel memcpy: one large copy, or many copies balanced by bytes.
//
// Pieces of at least kStreamMinBytes go through stream_copy: non-temporal
// (cache-bypassing) stores, which skip the read-for-ownership of every
// destination line. glibc's memcpy switches to such stores only above ~3/4 of
// the last-level cache, so a save that copies 16 MiB chunks would otherwise pay
// ~1.5x the time of one huge memcpy of the same bytes (measured here). Staged
// bytes are read again only later by the encoder threads, so bypassing the
// cache costs nothing. The widest store the CPU supports is chosen at run
// time (AVX-512F, AVX2, SSE2 on x86-64; memcpy elsewhere).
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CKPT_STREAM_X86 1
#else
#define CKPT_STREAM_X86 0
#endif

namespace ckpt {
namespace {

constexpr std::size_t kChunkAlign = 4096;  // chunk boundaries on page multiples
constexpr std::size_t kStreamMinBytes = std::size_t(1) << 20;

#if CKPT_STREAM_X86
// Each copies n bytes with 64-byte-aligned non-temporal stores for the body;
// head and tail go through memcpy. Followed by sfence (stores globally visible
// before the copy returns, as with memcpy).
using StreamFn = void (*)(char*, const char*, std::size_t);

inline std::size_t align_head(char* d, std::size_t n) {
    std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(d) & 63)) & 63;
    return head < n ? head : n;
}

__attribute__((target("avx512f"))) void stream_avx512(char* d, const char* s, std::size_t n) {
    std::size_t head = align_head(d, n);
    std::memcpy(d, s, head);
    d += head, s += head, n -= head;
    std::size_t body = n & ~std::size_t(255);
    for (std::size_t i = 0; i < body; i += 256) {
        __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
        __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
    }
    _mm_sfence();
    std::memcpy(d + body, s + body, n - body);
}

__attribute__((target("avx2"))) void stream_avx2(char* d, const char* s, std::size_t n) {
    std::size_t head = align_head(d, n);
    std::memcpy(d, s, head);
    d += head, s += head, n -= head;
    std::size_t body = n & ~std::size_t(127);
    for (std::size_t i = 0; i < body; i += 128) {
        auto* in = reinterpret_cast<const __m256i*>(s + i);
        __m256i a = _mm256_loadu_si256(in), b = _mm256_loadu_si256(in + 1);
        __m256i c = _mm256_loadu_si256(in + 2), e = _mm256_loadu_si256(in + 3);
        auto* out = reinterpret_cast<__m256i*>(d + i);
        _mm256_stream_si256(out, a);
        _mm256_stream_si256(out + 1, b);
        _mm256_stream_si256(out + 2, c);
        _mm256_stream_si256(out + 3, e);
    }
    _mm_sfence();
    std::memcpy(d + body, s + body, n - body);
}

void stream_sse2(char* d, const char* s, std::size_t n) {
    std::size_t head = align_head(d, n);
    std::memcpy(d, s, head);
    d += head, s += head, n -= head;
    std::size_t body = n & ~std::size_t(63);
    for (std::size_t i = 0; i < body; i += 64) {
        auto* in = reinterpret_cast<const __m128i*>(s + i);
        __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
        __m128i c = _mm_loadu_si128(in + 2), e = _mm_loadu_si128(in + 3);
        auto* out = reinterpret_cast<__m128i*>(d + i);
        _mm_stream_si128(out, a);
        _mm_stream_si128(out + 1, b);
        _mm_stream_si128(out + 2, c);
        _mm_stream_si128(out + 3, e);
    }
    _mm_sfence();
    std::memcpy(d + body, s + body, n - body);
}

StreamFn pick_stream() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return stream_avx512;
    if (__builtin_cpu_supports("avx2")) return stream_avx2;
    return stream_sse2;
}

const StreamFn g_stream = pick_stream();
#endif

// memcpy, with non-temporal stores for large pieces.
inline void copy_piece(char* d, const char* s, std::size_t n) {
#if CKPT_STREAM_X86
    if (n >= kStreamMinBytes) {
        g_stream(d, s, n);
        return;
    }
#endif
    std::memcpy(d, s, n);
}

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
        copy_piece(static_cast<char*>(dst), static_cast<const char*>(src), nbytes);
        return;
    }
    std::size_t chunk = (nbytes + nchunks - 1) / nchunks;
    chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    nchunks = (nbytes + chunk - 1) / chunk;
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    parallel_for(nchunks, threads, [&](std::size_t i) {
        std::size_t off = i * chunk;
        copy_piece(d + off, s + off, std::min(chunk, nbytes - off));
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
            copy_piece(reinterpret_cast<char*>(dsts[k] + off),
                       reinterpret_cast<const char*>(srcs[k] + off), b - a);
        }
    };
    if (nchunks == 1) run(0);
    else parallel_for(nchunks, threads, run);
}

}  // namespace ckpt
