// Stand-in for cuda_stage.cpp in builds configured with CKPTSTORE_CUDA=OFF: the
// module imports and reports {"compiled": false}; ckptstore.native then uses torch.
#include <stdexcept>

#include "cuda_ops.h"

namespace ckpt {

const CudaInfo& cuda_info() {
    static const CudaInfo info = [] {
        CudaInfo i;
        i.error = "ckptstore._C was built without its CUDA path (CKPTSTORE_CUDA=OFF)";
        return i;
    }();
    return info;
}

void* cuda_host_alloc(std::size_t, int, std::string* err, int*) {
    if (err) *err = cuda_info().error;
    return nullptr;
}

void cuda_host_free(void*, int) {}

int cuda_current_device() { return -1; }

const char* gather_ptx() { return ""; }

CudaDeviceInfo cuda_prepare(int) {
    throw std::runtime_error("CUDA staging unavailable: " + cuda_info().error);
}

CudaBatch::~CudaBatch() = default;
bool CudaBatch::query() { return true; }
void CudaBatch::wait() {}

std::unique_ptr<CudaBatch> cuda_stage(int, std::uintptr_t, const CopySpec*, std::size_t, std::size_t,
                                      bool, double) {
    throw std::runtime_error("CUDA staging unavailable: " + cuda_info().error);
}

}  // namespace ckpt
