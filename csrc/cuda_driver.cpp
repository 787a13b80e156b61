// The CUDA driver API loaded with dlopen (see cuda_driver.h).
#include "cuda_driver.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>
#include <stdexcept>
#include <vector>

namespace ckpt::cu {
namespace {

struct Loaded {
    Api api{};
    bool ok = false;
    std::string error, path;
    int driver = 0;
};

// Resolves `name` into `slot`; records the first missing one.
template <typename Fn>
void bind(void* lib, Fn& slot, const char* name, std::string& missing) {
    slot = reinterpret_cast<Fn>(dlsym(lib, name));
    if (!slot && missing.empty()) missing = name;
}

Loaded load() {
    Loaded L;
    // RTLD_NOLOAD first: torch has usually opened the driver already.
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char* e = dlerror();
        L.error = std::string("the NVIDIA driver library libcuda.so.1 was not found (") +
                  (e ? e : "dlopen failed") + ")";
        return L;
    }
    // Kept open for the life of the process: batches may outlive any caller.
    if (link_map* lm = nullptr; dlinfo(lib, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name)
        L.path = lm->l_name;
    Api& a = L.api;
    std::string missing;
    bind(lib, a.GetErrorName, "cuGetErrorName", missing);
    bind(lib, a.GetErrorString, "cuGetErrorString", missing);
    bind(lib, a.Init, "cuInit", missing);
    bind(lib, a.DriverGetVersion, "cuDriverGetVersion", missing);
    bind(lib, a.DeviceGetCount, "cuDeviceGetCount", missing);
    bind(lib, a.DeviceGet, "cuDeviceGet", missing);
    bind(lib, a.DeviceGetAttribute, "cuDeviceGetAttribute", missing);
    bind(lib, a.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", missing);
    bind(lib, a.CtxGetCurrent, "cuCtxGetCurrent", missing);
    bind(lib, a.CtxSetCurrent, "cuCtxSetCurrent", missing);
    bind(lib, a.CtxGetDevice, "cuCtxGetDevice", missing);
    bind(lib, a.MemHostAlloc, "cuMemHostAlloc", missing);
    bind(lib, a.MemFreeHost, "cuMemFreeHost", missing);
    bind(lib, a.MemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", missing);
    bind(lib, a.MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", missing);
    bind(lib, a.StreamCreate, "cuStreamCreate", missing);
    bind(lib, a.StreamDestroy, "cuStreamDestroy_v2", missing);
    bind(lib, a.StreamWaitEvent, "cuStreamWaitEvent", missing);
    bind(lib, a.StreamSynchronize, "cuStreamSynchronize", missing);
    bind(lib, a.EventCreate, "cuEventCreate", missing);
    bind(lib, a.EventRecord, "cuEventRecord", missing);
    bind(lib, a.EventQuery, "cuEventQuery", missing);
    bind(lib, a.EventSynchronize, "cuEventSynchronize", missing);
    bind(lib, a.EventDestroy, "cuEventDestroy_v2", missing);
    bind(lib, a.ModuleLoadData, "cuModuleLoadData", missing);
    bind(lib, a.ModuleGetFunction, "cuModuleGetFunction", missing);
    bind(lib, a.ModuleUnload, "cuModuleUnload", missing);
    bind(lib, a.FuncGetAttribute, "cuFuncGetAttribute", missing);
    bind(lib, a.LaunchKernel, "cuLaunchKernel", missing);
    if (!missing.empty()) {
        L.error = "libcuda.so.1 (" + L.path + ") lacks the entry point " + missing +
                  ": the NVIDIA driver is too old";
        return L;
    }
    std::string optional;  // absent before CUDA 12.4: loading by attribute query instead
    bind(lib, a.FuncLoad, "cuFuncLoad", optional);
    if (a.DriverGetVersion(&L.driver) != kSuccess) L.driver = 0;
    if (L.driver && L.driver < kMinDriverVersion) {
        L.error = "the NVIDIA driver supports CUDA " + std::to_string(L.driver / 1000) + "." +
                  std::to_string(L.driver % 1000 / 10) + "; ckptstore's CUDA path needs CUDA " +
                  std::to_string(kMinDriverVersion / 1000) + ".0 (driver >= 450)";
        return L;
    }
    L.ok = true;  // error_text works from here on
    if (CUresult r = a.Init(0); r != kSuccess) {
        L.ok = false;
        std::string name = "error " + std::to_string(r);
        const char* s = nullptr;
        if (a.GetErrorName(r, &s) == kSuccess && s) name = s;
        L.error = "cuInit failed: " + name;
        if (a.GetErrorString(r, &s) == kSuccess && s) L.error += std::string(" (") + s + ")";
    }
    return L;
}

const Loaded& loaded() {
    static const Loaded L = load();
    return L;
}

std::mutex g_ctx_m;
std::vector<CUcontext> g_primary;  // per device; retained once, never released

}  // namespace

const Api* api() { return loaded().ok ? &loaded().api : nullptr; }
const std::string& load_error() { return loaded().error; }
const std::string& library_path() { return loaded().path; }
int driver_version() { return loaded().driver; }

std::string error_text(CUresult r) {
    const Loaded& L = loaded();
    const char* name = nullptr;
    const char* desc = nullptr;
    if (L.api.GetErrorName) L.api.GetErrorName(r, &name);
    if (L.api.GetErrorString) L.api.GetErrorString(r, &desc);
    std::string out = name ? name : "CUDA driver error " + std::to_string(r);
    if (desc) out += std::string(" (") + desc + ")";
    return out;
}

void check(CUresult r, const char* what) {
    if (r != kSuccess) throw std::runtime_error(std::string(what) + " failed: " + error_text(r));
}

CUcontext primary_ctx(int device) {
    const Api* a = api();
    if (!a) throw std::runtime_error("CUDA driver unavailable: " + load_error());
    std::lock_guard<std::mutex> lk(g_ctx_m);
    if (device < 0) throw std::invalid_argument("no CUDA device " + std::to_string(device));
    if (g_primary.size() <= static_cast<std::size_t>(device)) g_primary.resize(device + 1, nullptr);
    if (!g_primary[device]) {
        CUdevice dev = 0;
        check(a->DeviceGet(&dev, device), "cuDeviceGet");
        CUcontext ctx = nullptr;
        check(a->DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
        g_primary[device] = ctx;
    }
    return g_primary[device];
}

CtxGuard::CtxGuard(int device) {
    const Api* a = api();
    if (!a) throw std::runtime_error("CUDA driver unavailable: " + load_error());
    CUcontext want = primary_ctx(device);
    check(a->CtxGetCurrent(&prev_), "cuCtxGetCurrent");
    if (prev_ != want) {
        check(a->CtxSetCurrent(want), "cuCtxSetCurrent");
        switched_ = true;
    }
}

CtxGuard::~CtxGuard() {
    if (switched_) api()->CtxSetCurrent(prev_);  // back to exactly the caller's (maybe none)
}

}  // namespace ckpt::cu
