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

// The entry points cuda_driver.cpp looks up by name exist under those names (the
// ABI names cuda.h maps its calls to) with the prototypes its Api struct assumes,
// written here in cuda.h's own types.
#include <type_traits>

#define CKPT_EXPECT(name, ...) static_assert(std::is_same_v<decltype(&::name), CUresult (*)(__VA_ARGS__)>, #name)
CKPT_EXPECT(cuGetErrorName, CUresult, const char**);
CKPT_EXPECT(cuGetErrorString, CUresult, const char**);
CKPT_EXPECT(cuInit, unsigned int);
CKPT_EXPECT(cuDriverGetVersion, int*);
CKPT_EXPECT(cuDeviceGetCount, int*);
CKPT_EXPECT(cuDeviceGet, CUdevice*, int);
CKPT_EXPECT(cuDeviceGetAttribute, int*, CUdevice_attribute, CUdevice);
CKPT_EXPECT(cuDevicePrimaryCtxRetain, CUcontext*, CUdevice);
CKPT_EXPECT(cuCtxGetCurrent, CUcontext*);
CKPT_EXPECT(cuCtxSetCurrent, CUcontext);
CKPT_EXPECT(cuCtxGetDevice, CUdevice*);
CKPT_EXPECT(cuMemHostAlloc, void**, size_t, unsigned int);
CKPT_EXPECT(cuMemFreeHost, void*);
CKPT_EXPECT(cuMemHostGetDevicePointer_v2, CUdeviceptr*, void*, unsigned int);
CKPT_EXPECT(cuMemcpyDtoHAsync_v2, void*, CUdeviceptr, size_t, CUstream);
CKPT_EXPECT(cuStreamCreate, CUstream*, unsigned int);
CKPT_EXPECT(cuStreamDestroy_v2, CUstream);
CKPT_EXPECT(cuStreamWaitEvent, CUstream, CUevent, unsigned int);
CKPT_EXPECT(cuStreamSynchronize, CUstream);
CKPT_EXPECT(cuEventCreate, CUevent*, unsigned int);
CKPT_EXPECT(cuEventRecord, CUevent, CUstream);
CKPT_EXPECT(cuEventQuery, CUevent);
CKPT_EXPECT(cuEventSynchronize, CUevent);
CKPT_EXPECT(cuEventDestroy_v2, CUevent);
CKPT_EXPECT(cuModuleLoadData, CUmodule*, const void*);
CKPT_EXPECT(cuModuleGetFunction, CUfunction*, CUmodule, const char*);
CKPT_EXPECT(cuModuleUnload, CUmodule);
CKPT_EXPECT(cuFuncGetAttribute, int*, CUfunction_attribute, CUfunction);
CKPT_EXPECT(cuLaunchKernel, CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
            unsigned int, unsigned int, CUstream, void**, void**);
CKPT_EXPECT(cuFuncLoad, CUfunction);
#undef CKPT_EXPECT
