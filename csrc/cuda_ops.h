// CUDA side of ckptstore._C: runtime probe, page-locked host memory, batched
// device-to-host copies. Implemented by cuda_stage.cu when CMake finds a CUDA
// toolkit (CKPTSTORE_WITH_CUDA), else by cuda_stub.cpp, which reports
// "not compiled". The CUDA runtime is linked statically and loads the driver
// lazily: importing the module never needs a GPU or libcuda.
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

namespace ckpt {

struct CudaInfo {
    bool compiled = false;   // built with the CUDA toolkit
    bool available = false;  // a driver and at least one device were found
    int devices = 0;
    int runtime_version = 0;  // CUDART_VERSION the module was built with (e.g. 13000)
    int driver_version = 0;   // 0 without a driver
    std::string error;        // why not available
};

// Probed once (thread-safe), on first call.
const CudaInfo& cuda_info();

// Page-locked, portable, device-mapped host memory (cudaHostAlloc; portable:
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
    void wait();  // blocks (sleeps) until then; call it without the GIL
    int device = -1;
    std::size_t count = 0, nbytes = 0;           // copies and bytes in the batch
    std::size_t gathered = 0, gathered_bytes = 0;  // of which by the gather kernel
    std::atomic<bool> finished{false};  // set last, once `error` is final
    std::string error;                  // the CUDA error the batch finished with, if any
    // Implementation state (cuda_stage.cu), guarded by `m` once the batch is returned.
    std::mutex m;
    void* event = nullptr;
    void* state = nullptr;
    void* desc = nullptr;      // page-locked descriptor buffer (host address)
    void* desc_dev = nullptr;  // its device address
    std::size_t desc_cap = 0;
};

// Enqueues `count` copies device -> host on `device` and returns at once.
// Copies smaller than small_bytes whose destination lies in a page-locked slab
// of a HostPool are done by one gather kernel that writes straight into host
// memory (gather=true); the rest by one cudaMemcpyAsync each. Throws
// std::runtime_error (CUDA errors) or std::invalid_argument.
std::unique_ptr<CudaBatch> cuda_stage(int device, std::uintptr_t producer_stream,
                                      const CopySpec* copies, std::size_t count,
                                      std::size_t small_bytes, bool gather);

}  // namespace ckpt
