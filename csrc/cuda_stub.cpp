// Stand-in for cuda_stage.cu in builds without the CUDA toolkit: the module
// imports and reports {"compiled": false}; ckptstore.native then uses torch.
#include <stdexcept>

#include "cuda_ops.h"

namespace ckpt {

const CudaInfo& cuda_info() {
    static const CudaInfo info = [] {
        CudaInfo i;
        i.error = "ckptstore._C was built without the CUDA toolkit";
        return i;
    }();
    return info;
}

void* cuda_host_alloc(std::size_t, int, std::string* err, int*) {
    if (err) *err = cuda_info().error;
    return nullptr;
}

void cuda_host_free(void*, int) {}

CudaBatch::~CudaBatch() = default;
bool CudaBatch::query() { return true; }
void CudaBatch::wait() {}

std::unique_ptr<CudaBatch> cuda_stage(int, std::uintptr_t, const CopySpec*, std::size_t, std::size_t,
                                      bool) {
    throw std::runtime_error("CUDA staging unavailable: " + cuda_info().error);
}

}  // namespace ckpt
