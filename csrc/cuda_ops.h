// CUDA side of ckptstore._C: driver probe, page-locked host memory, batched
// device-to-host copies. Implemented by cuda_stage.cpp on the CUDA driver API,
// loaded at run time (cuda_driver.h: no CUDA toolkit or runtime needed to build
// or import), else (CKPTSTORE_CUDA=OFF) by cuda_stub.cpp, which reports
// "not compiled".
//
// Pointers, device ids and stream handles are plain integers (a stream handle
// is the value of torch.cuda.Stream.cuda_stream); nothing here knows torch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ckpt {

struct CudaInfo {
    bool compiled = false;   // built with the CUDA path (CKPTSTORE_CUDA not OFF)
    bool available = false;  // a driver and at least one device were found
    int devices = 0;
    int runtime_version = 0;      // 0: no CUDA runtime is linked (driver API only)
    int driver_version = 0;       // cuDriverGetVersion, 0 without a driver
    int min_driver_version = 0;   // the oldest the gather kernel's PTX loads on
    std::string api;              // "driver" (the CUDA driver API through dlopen)
    std::string library;          // where libcuda was loaded from
    std::string kernel;           // the gather kernel's image, e.g. "PTX 7.0 sm_50"
    std::string error;            // why not available
};

// What cuda_prepare found for one device.
struct CudaDeviceInfo {
    int device = -1;
    int cc_major = 0, cc_minor = 0;
    bool gather = false;       // the gather kernel is loaded (else one copy per small piece)
    std::string gather_error;  // why not
};

// Creates `device`'s staging state now (stream, events, and the gather kernel,
// loaded eagerly: lazy module loading could synchronise in the middle of a
// save). cuda_stage does it on a device's first use; callers that know the
// device earlier (the staging pool, prepare) call this outside the save.
// Retains the device's primary context (torch's). Throws on CUDA errors.
CudaDeviceInfo cuda_prepare(int device);

// The device of the calling thread's current context, or -1 when it has none
// (or CUDA is unavailable). Creates nothing.
int cuda_current_device();

// The gather kernel's PTX as embedded in the module ("" without the CUDA path).
const char* gather_ptx();

// Probed once (thread-safe), on first call.
const CudaInfo& cuda_info();

// Page-locked, portable, device-mapped host memory (cuMemHostAlloc; portable:
// usable from every device's context). Made under the calling thread's current
// context when it has one (no switch, so no context is created anywhere), else
// under `device`'s primary context; *used_device (optional) receives the device
// whose context made it, to be passed to cuda_host_free. nullptr (and *err) on
// failure.
void* cuda_host_alloc(std::size_t nbytes, int device, std::string* err, int* used_device = nullptr);
void cuda_host_free(void* p, int device);

struct CopySpec {
    std::uintptr_t src;  // device pointer on the batch's device
    std::uintptr_t dst;  // host pointer
    std::size_t nbytes;
};

// One staged batch: the copies run on the device's staging stream after
// everything enqueued on the producer stream before cuda_stage was called.
// Destroying an unfinished batch is safe: its resources are recycled once its
// event completes. query() and wait() may be called from several threads at
// once: the batch is finished (event destroyed, descriptors recycled) exactly
// once, under `m`; a CUDA error is kept and thrown by every later call.
// With a deadline (timeout > 0), wait() polls the completion event and fails
// after `timeout` seconds: the batch is then failed for good, its event and
// descriptors go to the graveyard (recycled if it ever completes), and its
// destinations are withheld from reuse by their HostPool (quarantine_host_range).
class CudaBatch {
  public:
    CudaBatch() = default;
    ~CudaBatch();
    CudaBatch(const CudaBatch&) = delete;
    CudaBatch& operator=(const CudaBatch&) = delete;
    // True once every copy has landed; false while they have not, or while
    // another thread is waiting on / querying the batch (it never blocks).
    // Throws std::runtime_error on a CUDA error.
    bool query();
    void wait();  // blocks (sleeps or polls) until then; call it without the GIL
    int device = -1;
    std::size_t count = 0, nbytes = 0;           // copies and bytes in the batch
    std::size_t gathered = 0, gathered_bytes = 0;  // of which by the gather kernel
    double timeout = 0;                 // seconds wait() may take; <= 0: no limit
    std::atomic<bool> finished{false};  // set last, once `error` is final
    bool timed_out = false;             // guarded by `m`
    std::string error;                  // the CUDA error the batch finished with, if any
    // Implementation state (cuda_stage.cu), guarded by `m` once the batch is returned.
    std::mutex m;
    void* event = nullptr;
    void* state = nullptr;
    void* desc = nullptr;      // page-locked descriptor buffer (host address)
    void* desc_dev = nullptr;  // its device address
    std::size_t desc_cap = 0;
    std::vector<std::pair<std::uintptr_t, std::size_t>> dsts;  // destinations (quarantined on timeout)
};

// Enqueues `count` copies device -> host on `device` and returns at once.
// Copies smaller than small_bytes whose destination lies in a page-locked slab
// of a HostPool are done by one gather kernel that writes straight into host
// memory (gather=true); the rest by one cuMemcpyDtoHAsync each. timeout: the
// batch's deadline for wait() in seconds (<= 0: none). Throws
// std::runtime_error (CUDA errors) or std::invalid_argument.
std::unique_ptr<CudaBatch> cuda_stage(int device, std::uintptr_t producer_stream,
                                      const CopySpec* copies, std::size_t count,
                                      std::size_t small_bytes, bool gather, double timeout = 0);

}  // namespace ckpt
