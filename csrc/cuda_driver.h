// The CUDA driver API, loaded at run time.
//
// libcuda.so.1 is opened with dlopen on first use and the entry points are looked
// up by their ABI names (the `_v2` ones where cuda.h maps a name to one). So the
// module links no CUDA library, needs no CUDA toolkit to build, imports on
// machines without a driver, and runs on every driver that supports the GPU: no
// CUDA runtime version ties it to a driver version (a static cudart 13 needs
// driver >= 580). The types and constants below are the few we use, with the
// values of cuda.h (checked against it by cuda_driver_check.cpp when the
// toolkit's headers are found at build time).
//
// torch's handles are driver handles: a cudaStream_t is a CUstream, a
// cudaEvent_t a CUevent, and torch's context on a device is its primary context.
#pragma once

#include <cstddef>
#include <string>

namespace ckpt::cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorNoDevice = 100;
constexpr CUresult kErrorNoBinaryForGpu = 209;
constexpr CUresult kErrorInvalidPtx = 218;
constexpr CUresult kErrorUnsupportedPtxVersion = 222;
constexpr CUresult kErrorNotReady = 600;

constexpr unsigned kMemHostAllocPortable = 0x01;
constexpr unsigned kMemHostAllocDeviceMap = 0x02;
constexpr unsigned kStreamNonBlocking = 0x1;
constexpr unsigned kEventBlockingSync = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr int kAttrCanMapHostMemory = 19;
constexpr int kAttrUnifiedAddressing = 41;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;
constexpr int kFuncAttrMaxThreadsPerBlock = 0;

// The oldest driver (cuDriverGetVersion) whose JIT takes the gather kernel's PTX
// ISA 7.0: CUDA 11.0, driver 450.
constexpr int kMinDriverVersion = 11000;

struct Api {
    CUresult (*GetErrorName)(CUresult, const char**);
    CUresult (*GetErrorString)(CUresult, const char**);
    CUresult (*Init)(unsigned);
    CUresult (*DriverGetVersion)(int*);
    CUresult (*DeviceGetCount)(int*);
    CUresult (*DeviceGet)(CUdevice*, int);
    CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext*);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetDevice)(CUdevice*);
    CUresult (*MemHostAlloc)(void**, std::size_t, unsigned);
    CUresult (*MemFreeHost)(void*);
    CUresult (*MemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned);
    CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, std::size_t, CUstream);
    CUresult (*StreamCreate)(CUstream*, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*EventCreate)(CUevent*, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*ModuleLoadData)(CUmodule*, const void*);
    CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*FuncGetAttribute)(int*, int, CUfunction);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**);
    CUresult (*FuncLoad)(CUfunction);  // CUDA 12.4+ drivers; nullptr before
};

// The driver's entry points, loaded once (thread-safe), and cuInit(0) done; or
// nullptr when that failed, with the reason (libcuda.so.1 not found, a missing
// entry point, a driver too old for the gather kernel's PTX, cuInit's error) in
// load_error().
const Api* api();
const std::string& load_error();
// Where libcuda was loaded from, its cuDriverGetVersion (0 when unknown).
const std::string& library_path();
int driver_version();

// "CUDA_ERROR_NAME (description)".
std::string error_text(CUresult r);
// Throws std::runtime_error("<what> failed: <error_text>") unless r is success.
void check(CUresult r, const char* what);

// `device`'s primary context (the one torch uses), retained once and kept for
// the life of the process. Throws on failure.
CUcontext primary_ctx(int device);

// Makes `device`'s primary context current on this thread and restores the
// caller's current context (possibly none) on destruction, so no call creates a
// context on a device the caller does not use, and the caller's state is kept.
class CtxGuard {
  public:
    explicit CtxGuard(int device);
    ~CtxGuard();
    CtxGuard(const CtxGuard&) = delete;
    CtxGuard& operator=(const CtxGuard&) = delete;

  private:
    CUcontext prev_ = nullptr;
    bool switched_ = false;
};

}  // namespace ckpt::cu
