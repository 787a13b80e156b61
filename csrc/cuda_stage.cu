// Batched device-to-host staging on a dedicated stream per device (see cuda_ops.h).
//
// A batch: record an event on the producer stream and make the staging stream
// wait for it (so the copies see everything the producer enqueued before), then
//   * copies < small_bytes into page-locked pool memory: one gather kernel, one
//     thread block per copy, reading the descriptors from mapped host memory
//     and writing the bytes straight into the (device-mapped) host buffers:
//     thousands of tiny tensors cost one launch instead of one DMA each;
//   * every other copy: cudaMemcpyAsync on the staging stream (copy engine);
// and record a completion event (blocking-sync: waiters sleep, not spin).
//
// Context hygiene: every entry point makes `device`'s primary context current
// and restores the caller's current context (possibly none) afterwards, through
// the driver's cuCtxGetCurrent/cuCtxSetCurrent, so no call creates a context on
// a device the process does not use.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_ops.h"
#include "host_pool.h"

#if CUDART_VERSION < 12000
#error "ckptstore's CUDA path needs CUDA 12.0 or newer (configure with -DCKPTSTORE_CUDA=OFF)"
#endif

namespace ckpt {
namespace {

std::string cuda_error_text(cudaError_t e) {
    return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear a non-sticky error
        throw std::runtime_error(std::string(what) + " failed: " + cuda_error_text(e));
    }
}

// ---- current-context guard ----------------------------------------------------

using CtxHandle = void*;
using CtxGetFn = int (*)(CtxHandle*);
using CtxSetFn = int (*)(CtxHandle);

struct DriverFns {
    CtxGetFn get = nullptr;
    CtxSetFn set = nullptr;
};

const DriverFns& driver_fns() {
    static const DriverFns fns = [] {
        DriverFns f;
        auto load = [](const char* name) -> void* {
            void* p = nullptr;
            cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
            cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
#else
            cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
            if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
                cudaGetLastError();
                return nullptr;
            }
            return p;
        };
        f.get = reinterpret_cast<CtxGetFn>(load("cuCtxGetCurrent"));
        f.set = reinterpret_cast<CtxSetFn>(load("cuCtxSetCurrent"));
        if (!f.get || !f.set) {
            // The runtime has loaded the driver library already: look the two
            // (unversioned, ABI-stable) symbols up in it directly.
            f.get = nullptr, f.set = nullptr;
            if (void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {  // kept open
                f.get = reinterpret_cast<CtxGetFn>(dlsym(h, "cuCtxGetCurrent"));
                f.set = reinterpret_cast<CtxSetFn>(dlsym(h, "cuCtxSetCurrent"));
            }
            if (!f.get || !f.set) f.get = nullptr, f.set = nullptr;
        }
        return f;
    }();
    return fns;
}

// The context current on the calling thread (nullptr: none), or false when the
// driver's context calls are unavailable and that cannot be told.
bool current_ctx(CtxHandle* out) {
    const DriverFns& f = driver_fns();
    *out = nullptr;
    return f.get && f.get(out) == 0;
}

class CtxGuard {
  public:
    explicit CtxGuard(int device) {
        // Restores exactly the caller's context, possibly none. Without the
        // driver's context calls (never seen in practice) it cannot tell whether
        // the thread had a context: cudaGetDevice reports device 0 on a thread
        // without one, and cudaSetDevice(0) to "restore" that would create a
        // context on device 0. So it then restores nothing and the thread stays
        // on `device`, whose context exists anyway.
        restore_ctx_ = current_ctx(&prev_ctx_);
        check(cudaSetDevice(device), "cudaSetDevice");
    }
    ~CtxGuard() {
        if (restore_ctx_) driver_fns().set(prev_ctx_);
    }
    CtxGuard(const CtxGuard&) = delete;
    CtxGuard& operator=(const CtxGuard&) = delete;

  private:
    CtxHandle prev_ctx_ = nullptr;
    bool restore_ctx_ = false;
};

// ---- the gather kernel ------------------------------------------------------------

struct CopyDesc {
    const unsigned char* src;
    unsigned char* dst;
    unsigned long long n;
};

template <typename V>
__device__ __forceinline__ void copy_vec(const unsigned char* s, unsigned char* d,
                                         unsigned long long n) {
    constexpr unsigned long long W = sizeof(V);
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    unsigned long long head = (W - (reinterpret_cast<unsigned long long>(s) & (W - 1))) & (W - 1);
    if (head > n) head = n;
    for (unsigned long long i = tid; i < head; i += nt) d[i] = s[i];
    const V* vs = reinterpret_cast<const V*>(s + head);
    V* vd = reinterpret_cast<V*>(d + head);
    unsigned long long nv = (n - head) / W;
    for (unsigned long long i = tid; i < nv; i += nt) vd[i] = vs[i];
    for (unsigned long long i = head + nv * W + tid; i < n; i += nt) d[i] = s[i];
}

__global__ void gather_kernel(const CopyDesc* __restrict__ descs, unsigned long long count) {
    __shared__ CopyDesc cur;
    for (unsigned long long c = blockIdx.x; c < count; c += gridDim.x) {
        if (threadIdx.x == 0) cur = descs[c];  // one read of host memory per copy
        __syncthreads();
        const unsigned char* s = cur.src;
        unsigned char* d = cur.dst;
        unsigned long long n = cur.n;
        unsigned long long mis = reinterpret_cast<unsigned long long>(s) ^
                                 reinterpret_cast<unsigned long long>(d);
        if ((mis & 15) == 0) copy_vec<uint4>(s, d, n);
        else if ((mis & 7) == 0) copy_vec<unsigned long long>(s, d, n);
        else if ((mis & 3) == 0) copy_vec<unsigned>(s, d, n);
        else copy_vec<unsigned char>(s, d, n);
        __syncthreads();  // `cur` is rewritten next round
    }
}

constexpr unsigned kThreads = 256;
constexpr unsigned long long kMaxBlocks = 65535;

// ---- per-device state (created on first use, never destroyed) ------------------

struct DescBuf {
    CopyDesc* host = nullptr;  // page-locked, mapped
    CopyDesc* dev = nullptr;   // the same memory as the device sees it
    std::size_t cap = 0;       // descriptors
};

struct DeviceState {
    int device = -1;
    cudaStream_t stream = nullptr;
    cudaEvent_t ready = nullptr;  // orders the staging stream after the producer
    std::mutex ready_m;           // held from recording `ready` to the stream's wait on it
    std::atomic<bool> gather_ok{false};
    std::mutex m;  // guards the fields below
    std::vector<DescBuf> free_descs;
    std::vector<std::pair<cudaEvent_t, DescBuf>> graveyard;  // dropped unfinished batches
};

std::mutex g_states_m;
std::vector<DeviceState*> g_states;  // leaked on purpose: CUDA may be gone at exit

// Needs `device` current (CtxGuard).
DeviceState* device_state(int device) {
    std::lock_guard<std::mutex> lk(g_states_m);
    if (g_states.size() <= static_cast<std::size_t>(device)) g_states.resize(device + 1, nullptr);
    if (!g_states[device]) {
        cudaStream_t stream = nullptr;
        check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
        cudaEvent_t ready = nullptr;
        cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
        if (e != cudaSuccess) {
            cudaStreamDestroy(stream);
            check(e, "cudaEventCreate");
        }
        auto* st = new DeviceState;
        st->device = device;
        st->stream = stream;
        st->ready = ready;
        int uva = 0, can_map = 0;
        cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, device);
        cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device);
        cudaGetLastError();
        st->gather_ok = uva && can_map;  // host pointer == device pointer for pool slabs
        g_states[device] = st;
    }
    return g_states[device];
}

DescBuf take_desc(DeviceState* st, std::size_t n) {
    {
        std::lock_guard<std::mutex> lk(st->m);
        // Best fit: the smallest buffer that holds n descriptors.
        auto it = st->free_descs.end();
        for (auto j = st->free_descs.begin(); j != st->free_descs.end(); ++j)
            if (j->cap >= n && (it == st->free_descs.end() || j->cap < it->cap)) it = j;
        if (it != st->free_descs.end()) {
            DescBuf d = *it;
            st->free_descs.erase(it);
            return d;
        }
    }
    DescBuf d;
    d.cap = 1024;
    while (d.cap < n) d.cap *= 2;
    void* p = nullptr;
    check(cudaHostAlloc(&p, d.cap * sizeof(CopyDesc), cudaHostAllocPortable | cudaHostAllocMapped),
          "cudaHostAlloc (descriptors)");
    d.host = static_cast<CopyDesc*>(p);
    void* dp = nullptr;
    cudaError_t e = cudaHostGetDevicePointer(&dp, p, 0);
    if (e != cudaSuccess) {
        cudaFreeHost(p);
        check(e, "cudaHostGetDevicePointer");
    }
    d.dev = static_cast<CopyDesc*>(dp);
    return d;
}

void put_desc(DeviceState* st, DescBuf d) {
    if (!d.host) return;
    std::lock_guard<std::mutex> lk(st->m);
    st->free_descs.push_back(d);
}

// Recycles what dropped batches held, once their events have completed.
void sweep(DeviceState* st) {
    std::vector<std::pair<cudaEvent_t, DescBuf>> pending;
    {
        std::lock_guard<std::mutex> lk(st->m);
        pending.swap(st->graveyard);
    }
    std::vector<std::pair<cudaEvent_t, DescBuf>> keep;
    for (auto& [ev, d] : pending) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaErrorNotReady) {
            keep.emplace_back(ev, d);
            continue;
        }
        cudaGetLastError();
        cudaEventDestroy(ev);
        put_desc(st, d);
    }
    std::lock_guard<std::mutex> lk(st->m);
    st->graveyard.insert(st->graveyard.end(), keep.begin(), keep.end());
}

DescBuf batch_desc(const CudaBatch& b) {
    DescBuf d;
    d.host = static_cast<CopyDesc*>(b.desc);
    d.dev = static_cast<CopyDesc*>(b.desc_dev);
    d.cap = b.desc_cap;
    return d;
}

// Destroys the event and recycles the descriptors of a batch known complete (or
// failed: `e`), once. Called with b.m held, or before the batch is shared.
void finish(CudaBatch& b, cudaError_t e = cudaSuccess, const char* what = nullptr) {
    if (b.finished.load(std::memory_order_acquire)) return;
    if (b.event) cudaEventDestroy(static_cast<cudaEvent_t>(b.event));
    b.event = nullptr;
    if (b.state) put_desc(static_cast<DeviceState*>(b.state), batch_desc(b));
    b.desc = b.desc_dev = nullptr;
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear a non-sticky error
        b.error = std::string(what ? what : "staging batch") + " failed: " + cuda_error_text(e);
    }
    b.finished.store(true, std::memory_order_release);  // last: readers then see `error`
}

// Throws the error a finished batch ended with.
void rethrow(const CudaBatch& b) {
    if (!b.error.empty()) throw std::runtime_error(b.error);
}

}  // namespace

// ---- public API --------------------------------------------------------------------

const CudaInfo& cuda_info() {
    static const CudaInfo info = [] {
        CudaInfo i;
        i.compiled = true;
        i.runtime_version = CUDART_VERSION;
        int drv = 0;
        if (cudaDriverGetVersion(&drv) == cudaSuccess) i.driver_version = drv;
        cudaGetLastError();
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess) {
            i.error = "cudaGetDeviceCount: " + cuda_error_text(e);
            cudaGetLastError();
            n = 0;
        } else if (n == 0) {
            i.error = "no CUDA device";
        }
        i.devices = n;
        i.available = n > 0;
        return i;
    }();
    return info;
}

void* cuda_host_alloc(std::size_t nbytes, int device, std::string* err, int* used_device) {
    const CudaInfo& info = cuda_info();
    if (!info.available) {
        if (err) *err = info.error;
        return nullptr;
    }
    // Portable: page-locked for every context, so whichever context makes it, it
    // serves every device. Mapped: device-addressable (UVA: the same address).
    constexpr unsigned kFlags = cudaHostAllocPortable | cudaHostAllocMapped;
    try {
        void* p = nullptr;
        cudaError_t e;
        int dev = device;
        CtxHandle cur = nullptr;
        if (current_ctx(&cur) && cur) {
            // The thread already has a context (e.g. the rank's own device after
            // torch.cuda.set_device): use it and switch nothing, so that a pool
            // created while "device 0" was current puts no context on GPU 0.
            if (cudaGetDevice(&dev) != cudaSuccess) {
                cudaGetLastError();
                dev = device;
            }
            e = cudaHostAlloc(&p, nbytes, kFlags);
        } else {
            CtxGuard g(device);
            e = cudaHostAlloc(&p, nbytes, kFlags);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            if (err) *err = "cudaHostAlloc(" + std::to_string(nbytes) + "): " + cuda_error_text(e);
            return nullptr;
        }
        if (used_device) *used_device = dev;
        return p;
    } catch (const std::exception& ex) {
        if (err) *err = ex.what();
        return nullptr;
    }
}

void cuda_host_free(void* p, int device) {
    if (!p) return;
    // `device` made the memory (cuda_host_alloc's used_device), so its context
    // exists: the switch creates none. Note: cudaFreeHost synchronizes the
    // device; slabs are only freed by trim() and capacity pressure, off the copy
    // path. Deferring the free to a background thread is left for later.
    try {
        CtxGuard g(device);
        cudaFreeHost(p);
        cudaGetLastError();
    } catch (...) {
        // CUDA is shutting down (process exit): the memory goes with the process.
    }
}

CudaBatch::~CudaBatch() {
    // The last reference is gone: no query()/wait() can run concurrently.
    if (finished.load(std::memory_order_acquire) || !event) return;
    try {
        auto* st = static_cast<DeviceState*>(state);
        CtxGuard g(device);
        cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
        if (e == cudaErrorNotReady && st) {
            std::lock_guard<std::mutex> lk(st->m);
            st->graveyard.emplace_back(static_cast<cudaEvent_t>(event), batch_desc(*this));
            event = nullptr;
            desc = desc_dev = nullptr;
            finished = true;
            return;
        }
        cudaGetLastError();
        finish(*this);
    } catch (...) {
    }
}

bool CudaBatch::query() {
    if (!finished.load(std::memory_order_acquire)) {
        // Another thread waiting on (or querying) the batch holds the lock: not
        // known complete yet; never block here.
        std::unique_lock<std::mutex> lk(m, std::try_to_lock);
        if (!lk.owns_lock()) return false;
        if (!finished.load(std::memory_order_acquire)) {
            CtxGuard g(device);
            cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
            if (e == cudaErrorNotReady) return false;
            finish(*this, e, "cudaEventQuery (staging batch)");
        }
    }
    rethrow(*this);
    return true;
}

void CudaBatch::wait() {
    if (!finished.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lk(m);
        if (!finished.load(std::memory_order_acquire)) {
            CtxGuard g(device);
            cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
            finish(*this, e, "cudaEventSynchronize (staging batch)");
        }
    }
    rethrow(*this);
}

std::unique_ptr<CudaBatch> cuda_stage(int device, std::uintptr_t producer_stream,
                                      const CopySpec* copies, std::size_t count,
                                      std::size_t small_bytes, bool gather) {
    const CudaInfo& info = cuda_info();
    if (!info.available) throw std::runtime_error("CUDA staging unavailable: " + info.error);
    if (device < 0 || device >= info.devices)
        throw std::invalid_argument("cuda_stage: no CUDA device " + std::to_string(device));
    CtxGuard g(device);
    cudaGetLastError();
    DeviceState* st = device_state(device);
    sweep(st);

    auto batch = std::make_unique<CudaBatch>();
    batch->device = device;
    batch->state = st;
    std::vector<CopyDesc> small;
    std::vector<const CopySpec*> large;
    for (std::size_t k = 0; k < count; ++k) {
        const CopySpec& c = copies[k];
        if (c.nbytes == 0) continue;
        if (!c.src || !c.dst)
            throw std::invalid_argument("cuda_stage: null pointer in copy " + std::to_string(k));
        ++batch->count;
        batch->nbytes += c.nbytes;
        if (gather && st->gather_ok && c.nbytes < small_bytes && is_registered_pinned(c.dst, c.nbytes))
            small.push_back(CopyDesc{reinterpret_cast<const unsigned char*>(c.src),
                                     reinterpret_cast<unsigned char*>(c.dst), c.nbytes});
        else
            large.push_back(&c);
    }

    // Order the staging stream after what the producer has enqueued so far. The
    // wait uses the record current when it is enqueued, so the device's one
    // `ready` event is re-recorded freely once the wait is in, not before.
    cudaError_t e;
    {
        std::lock_guard<std::mutex> lk(st->ready_m);
        e = cudaEventRecord(st->ready, reinterpret_cast<cudaStream_t>(producer_stream));
        if (e == cudaSuccess) e = cudaStreamWaitEvent(st->stream, st->ready, 0);
    }
    check(e, "ordering after the producer stream (cudaEventRecord/cudaStreamWaitEvent)");

    cudaEvent_t done = nullptr;
    check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming | cudaEventBlockingSync),
          "cudaEventCreate");
    batch->event = done;
    try {
        if (!small.empty()) {
            DescBuf d = take_desc(st, small.size());
            batch->desc = d.host;
            batch->desc_dev = d.dev;
            batch->desc_cap = d.cap;
            std::memcpy(d.host, small.data(), small.size() * sizeof(CopyDesc));
            auto blocks = static_cast<unsigned>(std::min<unsigned long long>(small.size(), kMaxBlocks));
            gather_kernel<<<blocks, kThreads, 0, st->stream>>>(d.dev, small.size());
            cudaError_t le = cudaGetLastError();
            if (le == cudaErrorNoKernelImageForDevice || le == cudaErrorInvalidDeviceFunction) {
                // Built for other architectures: copy these one by one from now on.
                st->gather_ok = false;
                for (const CopyDesc& c : small)
                    check(cudaMemcpyAsync(c.dst, c.src, c.n, cudaMemcpyDeviceToHost, st->stream),
                          "cudaMemcpyAsync (device to host)");
            } else {
                check(le, "gather kernel launch");
                batch->gathered = small.size();
                for (const CopyDesc& c : small) batch->gathered_bytes += c.n;
            }
        }
        for (const CopySpec* c : large)
            check(cudaMemcpyAsync(reinterpret_cast<void*>(c->dst), reinterpret_cast<const void*>(c->src),
                                  c->nbytes, cudaMemcpyDeviceToHost, st->stream),
                  "cudaMemcpyAsync (device to host)");
        check(cudaEventRecord(done, st->stream), "cudaEventRecord (staging batch)");
    } catch (...) {
        // Queued work may still read the descriptors: let it drain before recycling.
        cudaStreamSynchronize(st->stream);
        cudaGetLastError();
        finish(*batch);
        throw;
    }
    return batch;
}

}  // namespace ckpt
