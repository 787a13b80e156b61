// A small persistent thread pool, created on first use and never destroyed
// (worker threads only sleep on a condition variable, so process exit is safe).
//
// A job is a counter of task indices. The caller posts the job once per helper
// it wants, then claims indices itself; workers that pick the job up claim
// indices too. The caller therefore finishes the job alone if no worker is free
// (or none exists, e.g. in a child after fork), so a job can never deadlock.
#include "ops.h"

#include <pthread.h>
#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ckpt {
namespace {

struct Job {
    const std::function<void(std::size_t)>* task;  // lives on the caller's stack
    std::size_t ntasks;
    std::atomic<std::size_t> next{0};  // next index to claim
    std::atomic<std::size_t> done{0};  // indices finished
    std::mutex m;
    std::condition_variable cv;

    // Claims and runs indices until none are left. `task` is only touched for
    // a claimed index < ntasks, i.e. while the caller is still waiting.
    void work() {
        for (std::size_t i; (i = next.fetch_add(1)) < ntasks;) {
            (*task)(i);
            if (done.fetch_add(1) + 1 == ntasks) {
                std::lock_guard<std::mutex> lk(m);
                cv.notify_all();
            }
        }
    }
};

class Pool {
  public:
    explicit Pool(unsigned nworkers) {
        for (unsigned i = 0; i < nworkers; ++i) std::thread([this] { loop(); }).detach();
        size_ = nworkers;
    }
    unsigned size() const { return size_; }

    void post(const std::shared_ptr<Job>& job, unsigned copies) {
        {
            std::lock_guard<std::mutex> lk(m_);
            for (unsigned i = 0; i < copies; ++i) queue_.push_back(job);
        }
        if (copies == 1) cv_.notify_one();
        else cv_.notify_all();
    }

  private:
    void loop() {
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [this] { return !queue_.empty(); });
                job = std::move(queue_.front());
                queue_.pop_front();
            }
            job->work();  // a stale entry (job already finished) claims nothing
        }
    }

    unsigned size_ = 0;
    std::mutex m_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<Job>> queue_;
};

std::atomic<Pool*> g_pool{nullptr};
std::mutex g_create;  // held while creating; locked around fork()

// After fork() only the forking thread exists in the child: forget (leak) the
// parent's pool so the child lazily builds its own.
void atfork_prepare() { g_create.lock(); }
void atfork_parent() { g_create.unlock(); }
void atfork_child() {
    g_pool.store(nullptr);
    g_create.unlock();
}
const int g_atfork = pthread_atfork(atfork_prepare, atfork_parent, atfork_child);

// Pool workers: one per hardware thread minus the caller, at most 63.
unsigned pool_workers() { return std::min(hardware_threads(), 64u) - 1; }

Pool* get_pool() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p) return p;
    std::lock_guard<std::mutex> lk(g_create);
    p = g_pool.load(std::memory_order_acquire);
    if (!p) {
        p = new Pool(pool_workers());  // intentionally leaked
        g_pool.store(p, std::memory_order_release);
    }
    return p;
}

}  // namespace

unsigned hardware_threads() {
    // Computed once: the query reads sysfs (microseconds), too slow per call.
    static const unsigned n = [] {
#if defined(__linux__)
        cpu_set_t set;  // CPUs this process may run on (cgroups, taskset)
        if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
            return static_cast<unsigned>(CPU_COUNT(&set));
#endif
        unsigned hc = std::thread::hardware_concurrency();
        return hc ? hc : 1u;
    }();
    return n;
}

unsigned resolve_threads(unsigned requested) {
    unsigned limit = pool_workers() + 1;
    if (requested == 0) requested = std::min(hardware_threads(), kMaxDefaultThreads);
    return std::max(1u, std::min(requested, limit));
}

void parallel_for(std::size_t ntasks, unsigned threads,
                  const std::function<void(std::size_t)>& task) {
    (void)g_atfork;
    // Threads besides the caller worth waking: one per remaining task at most.
    std::size_t helpers = std::min<std::size_t>(ntasks, std::max(threads, 1u)) - 1;
    Pool* pool = helpers ? get_pool() : nullptr;
    if (pool) helpers = std::min<std::size_t>(helpers, pool->size());
    if (helpers == 0) {
        for (std::size_t i = 0; i < ntasks; ++i) task(i);
        return;
    }
    auto job = std::make_shared<Job>();
    job->task = &task;
    job->ntasks = ntasks;
    pool->post(job, static_cast<unsigned>(helpers));
    job->work();
    std::unique_lock<std::mutex> lk(job->m);
    job->cv.wait(lk, [&] { return job->done.load() == ntasks; });
}

}  // namespace ckpt
