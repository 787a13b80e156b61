// Compile-time check (built only when a CUDA toolkit's cuda.h is found): the
// constants cuda_driver.h copies from cuda.h have cuda.h's values. No code.
#include <cuda.h>

#include "cuda_driver.h"

namespace cu = ckpt::cu;
static_assert(cu::kSuccess == CUDA_SUCCESS);
static_assert(cu::kErrorNoDevice == CUDA_ERROR_NO_DEVICE);
static_assert(cu::kErrorNoBinaryForGpu == CUDA_ERROR_NO_BINARY_FOR_GPU);
static_assert(cu::kErrorInvalidPtx == CUDA_ERROR_INVALID_PTX);
static_assert(cu::kErrorUnsupportedPtxVersion == CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
static_assert(cu::kErrorNotReady == CUDA_ERROR_NOT_READY);
static_assert(cu::kMemHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(cu::kMemHostAllocDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP);
static_assert(cu::kStreamNonBlocking == CU_STREAM_NON_BLOCKING);
static_assert(cu::kEventBlockingSync == CU_EVENT_BLOCKING_SYNC);
static_assert(cu::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(cu::kAttrCanMapHostMemory == CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
static_assert(cu::kAttrUnifiedAddressing == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
static_assert(cu::kAttrComputeCapabilityMajor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(cu::kAttrComputeCapabilityMinor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(cu::kFuncAttrMaxThreadsPerBlock == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
static_assert(sizeof(cu::CUdeviceptr) == sizeof(CUdeviceptr));
static_assert(sizeof(cu::CUdevice) == sizeof(CUdevice));
static_assert(sizeof(cu::CUresult) == sizeof(CUresult));
