// Host staging pool: large slabs (page-locked when CUDA is there), sub-allocated
// at exact sizes (rounded up to the alignment only), kept and reused across saves.
// Plain C++17, no Python; module.cpp binds it as ckptstore._C.HostPool.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace ckpt {

// Bytes a pool has dropped and the reclaimer thread has not freed yet: they still
// count against the pool's capacity, and waiters learn when they are gone.
struct Reclaim {
    std::mutex m;
    std::condition_variable cv;
    std::size_t pending = 0;  // guarded by m
    void done(std::size_t n);
};

// One contiguous region of host memory. Its memory is released when the last
// reference (the pool's, or a Block's) goes away, so a stale buffer object that
// outlives its slab's removal from the pool never points at unmapped memory.
// The memory is then freed by the reclaimer thread, never by the thread that
// drops the last reference: cuMemFreeHost synchronises the device, and the last
// reference may be dropped on a saving thread or with the GIL held.
struct Slab {
    Slab(std::size_t size, bool want_pinned, int device);  // throws std::bad_alloc
    ~Slab();
    Slab(const Slab&) = delete;
    Slab& operator=(const Slab&) = delete;
    // Has the kernel provide every page now (MADV_POPULATE_WRITE, else a write per
    // page) so copies into it later take no page faults. Only before the slab is
    // lent: the fallback writes zeros. Pinned slabs are resident already.
    void prefault();
    // Populates [from, to) with MADV_POPULATE_WRITE, which never changes contents (safe
    // while other parts of the range are lent); best effort: a no-op before Linux 5.14.
    void populate(std::size_t from, std::size_t to) const;

    std::uintptr_t base = 0;
    std::size_t size = 0;      // usable bytes
    std::size_t map_len = 0;   // bytes mapped (size rounded up to pages), ordinary slabs
    bool pinned = false;       // page-locked by the CUDA runtime
    int device = -1;           // whose context page-locked it (cuda_host_alloc's used_device)
    std::string pin_error;     // why pinning failed, when it was wanted
    std::uint64_t id = 0;      // set by the pool; lower = older
    pid_t owner = getpid();    // the process that mapped it (see ~Slab: forks)
    // Guarded by the owning pool's mutex:
    std::map<std::size_t, std::size_t> free;  // offset -> length, coalesced
    std::size_t used = 0;                     // bytes lent (spans)
    std::size_t populated = 0;                // bytes from the start whose pages were populated
    std::shared_ptr<Reclaim> reclaim;         // set when the pool dropped it and counts it as pending
};

// Waits until the reclaimer has freed every slab handed to it so far.
void flush_reclaims();

// Ordinary memory lent when no slab has room (fragmentation); freed with the Block.
struct OverflowMem {
    explicit OverflowMem(std::size_t n);  // throws std::bad_alloc
    ~OverflowMem();
    void* p = nullptr;
};

// One allocation lent by a HostPool. Exposed to Python with the buffer protocol.
struct Block {
    std::uintptr_t ptr = 0;
    std::size_t nbytes = 0;  // as requested
    std::size_t span = 0;    // carved from the slab: nbytes rounded up to the alignment
    std::size_t offset = 0;  // within the slab
    std::shared_ptr<Slab> slab;              // null for overflow and zero-size blocks
    std::shared_ptr<OverflowMem> overflow;   // set for overflow blocks
    std::uint64_t pool_id = 0;               // which pool lent it
    bool live = false;                       // lent and not yet freed
    bool pinned() const { return slab && slab->pinned; }
};

struct PoolStats {
    std::size_t capacity, held, in_use, used, cached, peak, peak_in_use, overflow_bytes,
        largest_free, slab_bytes, alignment;
    std::size_t reclaiming, quarantined;
    std::size_t slabs, pinned_slabs, live_blocks, allocs, slab_allocs, slab_frees,
        overflow_allocs, pin_failures, fragmentation_fails, reclaim_fails;
    bool pinned;
    std::string pin_error;
};

class HostPool {
  public:
    // capacity: most bytes lent at once (back-pressure bound) and most slab bytes
    // held (rounded up to the alignment). want_pinned: page-lock slabs with
    // cudaHostAlloc (portable: good for every device), under the allocating
    // thread's current context, or `device`'s when the thread has none
    // (ignored without a usable CUDA runtime).
    // slab_bytes: usual slab size. alignment: of every block (power of two, >= 16).
    HostPool(std::size_t capacity, bool want_pinned, int device, std::size_t slab_bytes,
             std::size_t alignment);
    ~HostPool();
    HostPool(const HostPool&) = delete;
    HostPool& operator=(const HostPool&) = delete;

    // Lends exactly nbytes (aligned) into `out` and returns true, or returns false
    // without waiting when in_use + nbytes > capacity, or when no hole is large
    // enough and the capacity leaves no room for a new slab even after freeing the
    // empty ones (fragmentation: the caller waits for a release, as for
    // back-pressure; once nothing is lent every request <= capacity fits). With
    // `overflow`, that second case lends ordinary memory beyond the capacity
    // instead (freed with the block; stats: overflow_allocs, overflow_bytes).
    // Throws std::invalid_argument when nbytes > capacity, std::bad_alloc.
    bool try_alloc(std::size_t nbytes, Block& out, bool overflow = false);
    // Returns a block; throws std::invalid_argument for a block not live in this pool.
    void free(Block& b);
    // Frees every slab that lends nothing (and waits until the reclaimer has
    // freed them); returns the bytes freed. The only place besides capacity
    // pressure that frees slabs.
    std::size_t trim();
    // Waits up to `timeout` seconds (< 0: no limit) until no dropped slab is
    // waiting to be freed; true when none is. For a caller whose try_alloc failed
    // while stats().reclaiming > 0: room appears once they are freed.
    bool wait_reclaimed(double timeout);
    // Makes new slabs, their pages faulted in, until the pool holds at least
    // min(nbytes, capacity) bytes; lends nothing. For a caller that knows how much
    // the next save will stage: its copies then take no page faults. Returns the
    // bytes of the new slabs (0 when the pool holds enough already).
    std::size_t warm(std::size_t nbytes);
    PoolStats stats() const;
    std::size_t in_use() const;
    std::size_t reclaim_fails() const;  // try_allocs that failed until dropped slabs are freed

    std::size_t capacity() const { return capacity_; }
    bool pinning() const { return pinning_; }

  private:
    using FreeKey = std::tuple<std::size_t, std::uint64_t, std::size_t>;  // (len, slab id, off)
    void add_free(Slab& s, std::size_t off, std::size_t len);   // coalesces
    void carve(Slab& s, std::size_t off, std::size_t len, std::size_t span);
    bool fit(std::size_t span, std::shared_ptr<Slab>& slab, std::size_t& off);
    void drop_slab(std::uint64_t id, std::vector<std::shared_ptr<Slab>>& out);
    void note_peak();
    std::size_t room() const;  // slab bytes that may still be made (held and pending count)
    void adopt(const std::shared_ptr<Slab>& s);  // a new slab joins the pool (its bytes already in held_)

    const std::size_t capacity_, slab_bytes_, align_, limit_;  // limit_: slab bytes bound
    const bool pinning_;
    const int device_;
    const std::uint64_t id_;
    const std::shared_ptr<Reclaim> reclaim_;
    mutable std::mutex m_;
    std::map<std::uint64_t, std::shared_ptr<Slab>> slabs_;
    std::set<FreeKey> by_size_;  // best fit: smallest length, then oldest slab, lowest offset
    std::uint64_t next_slab_id_ = 1;
    std::size_t held_ = 0, in_use_ = 0, used_ = 0, overflow_bytes_ = 0, peak_ = 0,
                peak_in_use_ = 0, live_ = 0;
    std::size_t allocs_ = 0, slab_allocs_ = 0, slab_frees_ = 0, overflow_allocs_ = 0,
                pin_failures_ = 0, frag_fails_ = 0, reclaim_fails_ = 0, quarantined_ = 0;
    std::string pin_error_;
};

// Registry of page-locked, device-mapped slabs (for the CUDA gather kernel,
// which writes straight into them). Thread-safe.
void register_pinned(std::uintptr_t base, std::size_t size);
void unregister_pinned(std::uintptr_t base);
bool is_registered_pinned(std::uintptr_t ptr, std::size_t nbytes);

// Host ranges that a device may still write into after its copy timed out
// (cuda_stage.cpp): a block overlapping one is never lent again once freed
// (stats: quarantined). Thread-safe.
void quarantine_host_range(std::uintptr_t ptr, std::size_t nbytes);
bool is_quarantined(std::uintptr_t ptr, std::size_t nbytes);

}  // namespace ckpt
