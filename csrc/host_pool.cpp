// Host staging pool (see host_pool.h).
//
// Free space is a per-slab map offset -> length (coalesced on every free) plus
// one index of all free regions ordered by (length, slab id, offset): best fit
// is one lower_bound, ties go to the oldest slab and the lowest address, which
// keeps newer slabs empty so that trim() and capacity pressure can free them.
//
// Slab memory is freed by one reclaimer thread per process, never by the thread
// that drops a slab's last reference (see host_pool.h).
#include "host_pool.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <new>
#include <stdexcept>
#include <thread>

#include "cuda_ops.h"

namespace ckpt {
namespace {

constexpr std::size_t kHuge = std::size_t(2) << 20;  // slab alignment (transparent huge pages)

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

std::size_t page_size() {
    static const std::size_t n = [] {
        long v = sysconf(_SC_PAGESIZE);
        return v > 0 ? static_cast<std::size_t>(v) : std::size_t(4096);
    }();
    return n;
}

std::atomic<std::uint64_t> g_pool_ids{1};

// Leaves the range out of children made by fork() (MADV_DONTFORK, as the CUDA driver
// does for page-locked memory): a DataLoader worker or any forked child never uses
// the parent's staging memory, and while one lives every page of a shared slab
// would be copied on the parent's next write into it (a save after each fork paid
// the page faults of a first save, and the child kept the old pages).
void leave_out_of_forks(void* p, std::size_t len) {
#ifdef MADV_DONTFORK
    madvise(p, len, MADV_DONTFORK);  // best effort: without it, copy-on-write as before
#else
    (void)p;
    (void)len;
#endif
}

// Anonymous private mapping of `len` bytes (a page multiple), 2 MiB aligned when
// at least 2 MiB so the kernel can back it with huge pages (fewer faults, TLB misses).
void* map_ordinary(std::size_t len) {
    if (len >= kHuge) {
        std::size_t total = len + kHuge;
        void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        auto a = reinterpret_cast<std::uintptr_t>(p);
        std::uintptr_t b = round_up(a, kHuge);
        if (b > a) munmap(p, b - a);
        std::size_t tail = (a + total) - (b + len);
        if (tail) munmap(reinterpret_cast<void*>(b + len), tail);
#ifdef MADV_HUGEPAGE
        madvise(reinterpret_cast<void*>(b), len, MADV_HUGEPAGE);
#endif
        leave_out_of_forks(reinterpret_cast<void*>(b), len);
        return reinterpret_cast<void*>(b);
    }
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    leave_out_of_forks(p, len);
    return p;
}

std::mutex g_reg_m;
std::map<std::uintptr_t, std::size_t> g_reg;  // base -> size of pinned, mapped slabs

std::mutex g_quar_m;
std::map<std::uintptr_t, std::size_t> g_quar;  // base -> size of quarantined host ranges
std::atomic<bool> g_any_quar{false};

// A forked child has none of the parent's slabs (MADV_DONTFORK; CUDA's page-locked
// memory likewise), so their addresses may hold its own memory: both registries start
// empty there, with fresh locks (a parent's thread may have held one). The old maps
// are left as they are, not destroyed: one may have been half-way through a change.
void registries_after_fork_in_child() {
    new (&g_reg_m) std::mutex;
    new (&g_reg) std::map<std::uintptr_t, std::size_t>;
    new (&g_quar_m) std::mutex;
    new (&g_quar) std::map<std::uintptr_t, std::size_t>;
    g_any_quar = false;
}
[[maybe_unused]] const int g_registries_atfork = pthread_atfork(nullptr, nullptr, registries_after_fork_in_child);

// ---- the reclaimer -------------------------------------------------------------

struct Doomed {  // a slab's memory, to be freed
    std::uintptr_t base;
    std::size_t map_len, size;
    bool pinned;
    int device;
    std::shared_ptr<Reclaim> reclaim;  // the pool counting it as pending, if any
};

void release_memory(const Doomed& d) {
    if (d.pinned) {
        unregister_pinned(d.base);
        cuda_host_free(reinterpret_cast<void*>(d.base), d.device);
    } else {
        munmap(reinterpret_cast<void*>(d.base), d.map_len);
    }
    if (d.reclaim) d.reclaim->done(d.size);
}

// One thread frees what the pools drop: cuMemFreeHost synchronises the device,
// so it must not run on a saving thread or with the GIL held. Leaked on purpose
// (its thread is detached and may outlive static destructors).
class Reclaimer {
  public:
    // Throws (no thread, no memory) before anything is queued: the caller frees.
    void push(const Doomed& d) {
        std::lock_guard<std::mutex> lk(m_);
        if (!started_) {
            std::thread([this] { run(); }).detach();
            started_ = true;
        }
        q_.push_back(d);
        cv_.notify_one();
    }
    void flush() {
        std::unique_lock<std::mutex> lk(m_);
        idle_.wait(lk, [&] { return q_.empty() && !busy_; });
    }
    // At exit (atexit, before the driver's own teardown): free nothing more, and let
    // a free in progress end first (bounded), so no driver call races its teardown.
    void stop() {
        std::unique_lock<std::mutex> lk(m_);
        exiting_ = true;
        idle_.wait_for(lk, std::chrono::seconds(5), [&] { return !busy_; });
    }

  private:
    void run() {
        std::unique_lock<std::mutex> lk(m_);
        while (true) {
            cv_.wait(lk, [&] { return !q_.empty(); });
            Doomed d = std::move(q_.front());
            q_.pop_front();
            if (exiting_) {  // the memory goes with the process
                if (q_.empty()) idle_.notify_all();
                continue;
            }
            busy_ = true;
            lk.unlock();
            release_memory(d);
            d.reclaim.reset();
            lk.lock();
            busy_ = false;
            idle_.notify_all();
        }
    }
    std::mutex m_;
    std::condition_variable cv_, idle_;
    std::deque<Doomed> q_;
    bool busy_ = false, started_ = false, exiting_ = false;
};

std::atomic<Reclaimer*> g_reclaimer{nullptr};
std::once_flag g_reclaimer_once;

Reclaimer& reclaimer() {
    std::call_once(g_reclaimer_once, [] {
        g_reclaimer = new Reclaimer;
        // A forked child has no reclaimer thread (and maybe a locked mutex): a fresh one.
        pthread_atfork(nullptr, nullptr, [] { g_reclaimer = new Reclaimer; });
        std::atexit([] { g_reclaimer.load()->stop(); });
    });
    return *g_reclaimer.load();
}

}  // namespace

void Reclaim::done(std::size_t n) {
    std::lock_guard<std::mutex> lk(m);
    pending -= n;
    cv.notify_all();
}

void flush_reclaims() { reclaimer().flush(); }

// ---- quarantine ----------------------------------------------------------------

void quarantine_host_range(std::uintptr_t ptr, std::size_t nbytes) {
    if (!nbytes) return;
    std::lock_guard<std::mutex> lk(g_quar_m);
    std::size_t& n = g_quar[ptr];
    n = std::max(n, nbytes);
    g_any_quar = true;
}

bool is_quarantined(std::uintptr_t ptr, std::size_t nbytes) {
    if (!g_any_quar.load() || !nbytes) return false;
    std::lock_guard<std::mutex> lk(g_quar_m);
    for (auto& [p, n] : g_quar)  // few: only batches that timed out
        if (p < ptr + nbytes && ptr < p + n) return true;
    return false;
}

// ---- registry ------------------------------------------------------------------

void register_pinned(std::uintptr_t base, std::size_t size) {
    std::lock_guard<std::mutex> lk(g_reg_m);
    g_reg[base] = size;
}

void unregister_pinned(std::uintptr_t base) {
    std::lock_guard<std::mutex> lk(g_reg_m);
    g_reg.erase(base);
}

bool is_registered_pinned(std::uintptr_t ptr, std::size_t nbytes) {
    std::lock_guard<std::mutex> lk(g_reg_m);
    auto it = g_reg.upper_bound(ptr);
    if (it == g_reg.begin()) return false;
    --it;
    return ptr >= it->first && nbytes <= it->second && ptr - it->first <= it->second - nbytes;
}

// ---- memory --------------------------------------------------------------------

Slab::Slab(std::size_t size_, bool want_pinned, int device_) : size(size_), device(device_) {
    if (want_pinned) {
        // Pinned under the thread's current context if it has one, else under
        // `device`'s; `device` becomes the one that pinned it (freed there).
        if (void* p = cuda_host_alloc(size, device, &pin_error, &device)) {
            base = reinterpret_cast<std::uintptr_t>(p);
            pinned = true;
            register_pinned(base, size);
            return;
        }
    }
    map_len = round_up(size, page_size());
    base = reinterpret_cast<std::uintptr_t>(map_ordinary(map_len));
}

Slab::~Slab() {
    if (!base) return;
    // A forked child never had this memory (MADV_DONTFORK; CUDA's page-locked memory
    // likewise): its range may hold the child's own mappings by now. Not ours to free.
    if (owner != getpid()) return;
    // A timed-out device copy may still land in a quarantined range: such memory is
    // never freed, so it is never mapped again for anything else (and the registry's
    // entries stay true).
    if (is_quarantined(base, size)) {
        if (reclaim) reclaim->done(size);  // never freed, but no longer pending: room stays right
        return;
    }
    Doomed d{base, map_len, size, pinned, device, std::move(reclaim)};
    try {
        reclaimer().push(d);
    } catch (...) {  // no memory for the queue, or no thread: free here
        release_memory(d);
    }
}

void Slab::prefault() {
    if (pinned || !base || !map_len) return;
#ifdef MADV_POPULATE_WRITE
    if (madvise(reinterpret_cast<void*>(base), map_len, MADV_POPULATE_WRITE) == 0) {
        populated = map_len;
        return;
    }
#endif
    volatile char* p = reinterpret_cast<volatile char*>(base);  // older kernels: touch each page
    for (std::size_t i = 0; i < map_len; i += page_size()) p[i] = 0;
    populated = map_len;
}

void Slab::populate(std::size_t from, std::size_t to) const {
#ifdef MADV_POPULATE_WRITE
    if (!pinned && to > from)
        madvise(reinterpret_cast<void*>(base + from), to - from, MADV_POPULATE_WRITE);
#else
    (void)from;
    (void)to;
#endif
}

OverflowMem::OverflowMem(std::size_t n) {
    if (posix_memalign(&p, 4096, n ? n : 1) != 0) throw std::bad_alloc();
}

OverflowMem::~OverflowMem() { std::free(p); }

// ---- pool ----------------------------------------------------------------------

HostPool::HostPool(std::size_t capacity, bool want_pinned, int device, std::size_t slab_bytes,
                   std::size_t alignment)
    : capacity_(capacity),
      slab_bytes_(std::max<std::size_t>(slab_bytes, 1)),
      align_(alignment),
      limit_(alignment && !(alignment & (alignment - 1)) ? round_up(capacity, alignment) : capacity),
      pinning_(want_pinned && cuda_info().available),
      device_(device),
      id_(g_pool_ids.fetch_add(1)),
      reclaim_(std::make_shared<Reclaim>()) {
    if (capacity == 0) throw std::invalid_argument("HostPool: capacity must be positive");
    if (alignment < 16 || (alignment & (alignment - 1)))
        throw std::invalid_argument("HostPool: alignment must be a power of two >= 16");
    if (want_pinned && !pinning_)
        pin_error_ = cuda_info().compiled ? cuda_info().error : "built without CUDA";
}

HostPool::~HostPool() = default;  // slabs go when their last Block does

std::size_t HostPool::room() const {
    std::size_t pending;
    {
        std::lock_guard<std::mutex> lk(reclaim_->m);
        pending = reclaim_->pending;
    }
    return limit_ > held_ + pending ? limit_ - held_ - pending : 0;
}

void HostPool::note_peak() {
    std::size_t pending;
    {
        std::lock_guard<std::mutex> lk(reclaim_->m);
        pending = reclaim_->pending;
    }
    peak_ = std::max(peak_, held_ + pending + overflow_bytes_);
    peak_in_use_ = std::max(peak_in_use_, in_use_);
}

void HostPool::carve(Slab& s, std::size_t off, std::size_t len, std::size_t span) {
    by_size_.erase(FreeKey{len, s.id, off});
    s.free.erase(off);
    if (len > span) {
        s.free[off + span] = len - span;
        by_size_.insert(FreeKey{len - span, s.id, off + span});
    }
    s.used += span;
    used_ += span;
}

void HostPool::add_free(Slab& s, std::size_t off, std::size_t len) {
    auto next = s.free.lower_bound(off);
    if (next != s.free.end() && next->first == off + len) {
        by_size_.erase(FreeKey{next->second, s.id, next->first});
        len += next->second;
        next = s.free.erase(next);
    }
    if (next != s.free.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == off) {
            by_size_.erase(FreeKey{prev->second, s.id, prev->first});
            off = prev->first;
            len += prev->second;
            s.free.erase(prev);
        }
    }
    s.free[off] = len;
    by_size_.insert(FreeKey{len, s.id, off});
}

bool HostPool::fit(std::size_t span, std::shared_ptr<Slab>& slab, std::size_t& off) {
    auto it = by_size_.lower_bound(FreeKey{span, 0, 0});
    if (it == by_size_.end()) return false;
    auto [len, sid, o] = *it;
    slab = slabs_.at(sid);
    off = o;
    carve(*slab, o, len, span);
    return true;
}

void HostPool::drop_slab(std::uint64_t id, std::vector<std::shared_ptr<Slab>>& out) {
    auto it = slabs_.find(id);
    Slab& s = *it->second;
    for (auto& [o, len] : s.free) by_size_.erase(FreeKey{len, s.id, o});
    held_ -= s.size;
    ++slab_frees_;
    // Still counted against the capacity until the reclaimer has freed it, unless
    // a Block object still holds it: then it lives as long as that object, and
    // counting it could keep the capacity taken for good.
    if (it->second.use_count() == 1) {
        std::lock_guard<std::mutex> lk(reclaim_->m);
        reclaim_->pending += s.size;
        s.reclaim = reclaim_;
    }
    out.push_back(std::move(it->second));
    slabs_.erase(it);
}

bool HostPool::try_alloc(std::size_t nbytes, Block& out, bool overflow) {
    if (nbytes > capacity_)
        throw std::invalid_argument("HostPool: a " + std::to_string(nbytes) +
                                    "-byte block exceeds the capacity " + std::to_string(capacity_));
    std::vector<std::shared_ptr<Slab>> dropped;  // destroyed after the lock is released
    std::unique_lock<std::mutex> lk(m_);
    if (in_use_ + nbytes > capacity_) return false;
    Block b;
    b.nbytes = nbytes;
    b.pool_id = id_;
    b.live = true;
    if (nbytes == 0) {  // nothing to lend; keeps the accounting uniform
        ++live_;
        ++allocs_;
        out = std::move(b);
        return true;
    }
    const std::size_t span = round_up(nbytes, align_);
    in_use_ += nbytes;  // reserved from here on
    auto undo = [&] { in_use_ -= nbytes; };

    std::shared_ptr<Slab> slab;
    std::size_t off = 0;
    if (!fit(span, slab, off)) {
        std::size_t room = this->room();
        if (room < span) {
            // Drop empty slabs, largest first, until a slab for this request fits
            // once they are freed. The reclaimer frees them (after the lock is
            // released, below); until then their bytes count as pending.
            auto after_reclaim = [&] { return limit_ > held_ ? limit_ - held_ : 0; };
            std::vector<std::pair<std::size_t, std::uint64_t>> empty;
            for (auto& [id, s] : slabs_)
                if (s->used == 0) empty.emplace_back(s->size, id);
            std::sort(empty.rbegin(), empty.rend());
            for (auto& [size, id] : empty) {
                if (after_reclaim() >= span) break;
                drop_slab(id, dropped);
            }
            room = this->room();
            if (room < span && after_reclaim() >= span) {
                // Room comes once the reclaimer has freed the dropped slabs: the
                // caller waits (wait_reclaimed) and tries again.
                undo();
                ++reclaim_fails_;
                lk.unlock();
                dropped.clear();  // hands them to the reclaimer
                return false;
            }
        }
        if (room >= span) {
            std::size_t want = std::max(round_up(span, kHuge), slab_bytes_);
            want = std::min(want, room / align_ * align_);  // >= span: both are multiples of align_
            held_ += want;  // reserved while the slab is made without the lock
            lk.unlock();
            std::shared_ptr<Slab> s;
            try {
                s = std::make_shared<Slab>(want, pinning_, device_);
            } catch (...) {
                lk.lock();
                held_ -= want;
                undo();
                throw;
            }
            lk.lock();
            adopt(s);
            carve(*s, 0, want, span);
            slab = s;
            off = 0;
        } else if (!overflow) {
            // Enough capacity by count, but no slab has a hole this large and the
            // live blocks pin every slab: wait for a release.
            undo();
            ++frag_fails_;
            return false;
        } else {
            // The same, with overflow allowed: ordinary memory, freed with the block.
            lk.unlock();
            std::shared_ptr<OverflowMem> mem;
            try {
                mem = std::make_shared<OverflowMem>(span);
            } catch (...) {
                lk.lock();
                undo();
                throw;
            }
            lk.lock();
            overflow_bytes_ += span;
            ++overflow_allocs_;
            ++live_;
            ++allocs_;
            b.ptr = reinterpret_cast<std::uintptr_t>(mem->p);
            b.span = span;
            b.overflow = std::move(mem);
            note_peak();
            out = std::move(b);
            return true;
        }
    }
    ++live_;
    ++allocs_;
    b.ptr = slab->base + off;
    b.span = span;
    b.offset = off;
    // First use of this part of the slab: have the kernel provide its pages in one
    // call, not in a fault per page during the copy (measured: 0.75 GiB copied into
    // fresh slabs took 0.35-0.84 s faulting, 0.07 s populated + 0.04 s copied).
    std::size_t pop_from = 0, pop_to = 0;
    if (!slab->pinned && slab->populated < off + span) {
        pop_from = slab->populated;
        pop_to = std::min(round_up(off + span, page_size()), slab->map_len);
        slab->populated = pop_to;
    }
    std::shared_ptr<Slab> to_populate = pop_to > pop_from ? slab : nullptr;
    b.slab = std::move(slab);
    note_peak();
    out = std::move(b);
    lk.unlock();
    if (to_populate) to_populate->populate(pop_from, pop_to);
    return true;
}

void HostPool::adopt(const std::shared_ptr<Slab>& s) {
    s->id = next_slab_id_++;
    slabs_[s->id] = s;
    ++slab_allocs_;
    if (pinning_ && !s->pinned) {
        ++pin_failures_;
        pin_error_ = s->pin_error;
    }
    s->free[0] = s->size;
    by_size_.insert(FreeKey{s->size, s->id, 0});
    note_peak();
}

std::size_t HostPool::warm(std::size_t nbytes) {
    std::size_t made = 0;
    while (true) {
        std::size_t want = 0;
        {
            std::lock_guard<std::mutex> lk(m_);
            const std::size_t target = std::min(round_up(nbytes, align_), limit_);
            if (held_ >= target) break;
            const std::size_t room = this->room() / align_ * align_;
            want = std::min(std::max(slab_bytes_, kHuge), room);
            if (want == 0) break;
            held_ += want;  // reserved while the slab is made and faulted without the lock
        }
        std::shared_ptr<Slab> s;
        try {
            s = std::make_shared<Slab>(want, pinning_, device_);
            s->prefault();  // before anyone can be lent its memory
        } catch (...) {
            std::lock_guard<std::mutex> lk(m_);
            held_ -= want;
            throw;
        }
        std::lock_guard<std::mutex> lk(m_);
        adopt(s);
        made += want;
    }
    return made;
}

void HostPool::free(Block& b) {
    std::lock_guard<std::mutex> lk(m_);
    if (!b.live || b.pool_id != id_)
        throw std::invalid_argument(b.pool_id == id_ ? "HostPool.free: block already freed"
                                                     : "HostPool.free: block of another pool");
    b.live = false;
    in_use_ -= b.nbytes;
    --live_;
    if (b.slab && is_quarantined(b.ptr, b.span)) {
        // A timed-out device copy may still write here: never lend it again.
        quarantined_ += b.span;
    } else if (b.slab) {
        add_free(*b.slab, b.offset, b.span);
        b.slab->used -= b.span;
        used_ -= b.span;
    } else if (b.overflow) {
        overflow_bytes_ -= b.span;
    }
    // The Block keeps its memory alive (a tensor may still view it); the pool
    // no longer counts it.
}

std::size_t HostPool::trim() {
    std::size_t freed = 0;
    std::vector<std::shared_ptr<Slab>> dropped;
    {
        std::lock_guard<std::mutex> lk(m_);
        std::vector<std::uint64_t> ids;
        for (auto& [id, s] : slabs_)
            if (s->used == 0) ids.push_back(id);
        for (auto id : ids) {
            freed += slabs_[id]->size;
            drop_slab(id, dropped);
        }
    }
    dropped.clear();  // to the reclaimer, outside the lock
    flush_reclaims();  // freed when trim returns, as callers expect
    return freed;
}

bool HostPool::wait_reclaimed(double timeout) {
    std::unique_lock<std::mutex> lk(reclaim_->m);
    auto none = [&] { return reclaim_->pending == 0; };
    if (timeout < 0) {
        reclaim_->cv.wait(lk, none);
        return true;
    }
    return reclaim_->cv.wait_for(lk, std::chrono::duration<double>(timeout), none);
}

std::size_t HostPool::reclaim_fails() const {
    std::lock_guard<std::mutex> lk(m_);
    return reclaim_fails_;
}

std::size_t HostPool::in_use() const {
    std::lock_guard<std::mutex> lk(m_);
    return in_use_;
}

PoolStats HostPool::stats() const {
    std::lock_guard<std::mutex> lk(m_);
    PoolStats st{};
    st.capacity = capacity_;
    st.held = held_;
    st.in_use = in_use_;
    st.used = used_;
    st.cached = held_ - used_;
    st.peak = peak_;
    st.peak_in_use = peak_in_use_;
    st.overflow_bytes = overflow_bytes_;
    st.largest_free = by_size_.empty() ? 0 : std::get<0>(*by_size_.rbegin());
    st.slab_bytes = slab_bytes_;
    st.alignment = align_;
    st.slabs = slabs_.size();
    for (auto& [id, s] : slabs_) st.pinned_slabs += s->pinned ? 1 : 0;
    st.live_blocks = live_;
    st.allocs = allocs_;
    st.slab_allocs = slab_allocs_;
    st.slab_frees = slab_frees_;
    st.overflow_allocs = overflow_allocs_;
    st.pin_failures = pin_failures_;
    st.fragmentation_fails = frag_fails_;
    st.reclaim_fails = reclaim_fails_;
    st.quarantined = quarantined_;
    {
        std::lock_guard<std::mutex> rl(reclaim_->m);
        st.reclaiming = reclaim_->pending;
    }
    st.pinned = pinning_;
    st.pin_error = pin_error_;
    return st;
}

}  // namespace ckpt
