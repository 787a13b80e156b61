/* A stand-in for the NVIDIA driver library, for tests/test_native_driver.py only:
 * on a machine without a GPU it lets the extension's driver-API path (loading,
 * contexts, streams, events, the deadline, pinned slabs, the gather launch) run.
 * "Device" memory is host memory (as with unified addressing, a device pointer
 * is a plain address); copies and the gather run at once, on the calling thread.
 * Knobs (environment): FAKE_CUDA_DRIVER (cuDriverGetVersion, default 12040),
 * FAKE_CUDA_NO_DEVICE=1 (cuInit fails), FAKE_CUDA_HANG=1 (events never complete),
 * FAKE_CUDA_NO_GATHER=1 (cuModuleLoadData fails), FAKE_CUDA_FAIL=<entry point> (cuEventCreate,
 * cuDeviceGetAttribute, cuModuleGetFunction or cuFuncLoad fails with CUDA_ERROR_OUT_OF_MEMORY).
 * Counters: fake_cuda_counter(): launches, copies, host frees, streams alive, events alive,
 * modules loaded. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
static int g_ctx_token; /* the one primary context */
static __thread void* t_current;
static long g_launches, g_memcpys, g_frees, g_streams, g_events, g_modules;

static int env_on(const char* k) { const char* v = getenv(k); return v && *v == '1'; }

static int fails(const char* entry) { const char* v = getenv("FAKE_CUDA_FAIL"); return v && !strcmp(v, entry); }

long fake_cuda_counter(int which) {
    long c[] = {g_launches, g_memcpys, g_frees, g_streams, g_events, g_modules};
    return c[which];
}

CUresult cuGetErrorName(CUresult r, const char** s) {
    *s = r == 0 ? "CUDA_SUCCESS" : r == 100 ? "CUDA_ERROR_NO_DEVICE" : r == 218 ? "CUDA_ERROR_INVALID_PTX"
       : r == 600 ? "CUDA_ERROR_NOT_READY" : r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
CUresult cuGetErrorString(CUresult r, const char** s) { *s = r == 100 ? "no CUDA-capable device is detected" : "fake"; return 0; }
CUresult cuInit(unsigned f) { (void)f; return env_on("FAKE_CUDA_NO_DEVICE") ? 100 : 0; }
CUresult cuDriverGetVersion(int* v) { const char* e = getenv("FAKE_CUDA_DRIVER"); *v = e ? atoi(e) : 12040; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGet(int* d, int i) { if (i != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) {
    (void)d;
    if (fails("cuDeviceGetAttribute")) return 2;
    *v = attr == 75 ? 9 : attr == 76 ? 0 : 1; /* capability 9.0; UVA, host mapping */
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { (void)d; *c = &g_ctx_token; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = t_current; return 0; }
CUresult cuCtxSetCurrent(void* c) { t_current = c; return 0; }
CUresult cuCtxGetDevice(int* d) { if (!t_current) return 201; *d = 0; return 0; }
CUresult cuMemHostAlloc(void** p, size_t n, unsigned f) { (void)f; return posix_memalign(p, 4096, n ? n : 1) ? 2 : 0; }
CUresult cuMemFreeHost(void* p) { free(p); __atomic_add_fetch(&g_frees, 1, __ATOMIC_SEQ_CST); return 0; }
CUresult cuMemHostGetDevicePointer_v2(unsigned long long* d, void* p, unsigned f) { (void)f; *d = (uintptr_t)p; return 0; }
CUresult cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* s) {
    (void)s;
    memcpy(dst, (const void*)(uintptr_t)src, n);
    __atomic_add_fetch(&g_memcpys, 1, __ATOMIC_SEQ_CST);
    return t_current ? 0 : 201;
}
CUresult cuStreamCreate(void** s, unsigned f) { (void)f; *s = malloc(1); __atomic_add_fetch(&g_streams, 1, __ATOMIC_SEQ_CST); return 0; }
CUresult cuStreamDestroy_v2(void* s) { free(s); __atomic_sub_fetch(&g_streams, 1, __ATOMIC_SEQ_CST); return 0; }
CUresult cuStreamWaitEvent(void* s, void* e, unsigned f) { (void)s; (void)e; (void)f; return 0; }
CUresult cuStreamSynchronize(void* s) { (void)s; return 0; }
CUresult cuEventCreate(void** e, unsigned f) {
    (void)f;
    if (fails("cuEventCreate")) return 2;
    *e = malloc(1);
    __atomic_add_fetch(&g_events, 1, __ATOMIC_SEQ_CST);
    return 0;
}
CUresult cuEventRecord(void* e, void* s) { (void)e; (void)s; return t_current ? 0 : 201; }
CUresult cuEventQuery(void* e) { (void)e; return env_on("FAKE_CUDA_HANG") ? 600 : 0; }
CUresult cuEventSynchronize(void* e) { (void)e; return 0; }
CUresult cuEventDestroy_v2(void* e) { free(e); __atomic_sub_fetch(&g_events, 1, __ATOMIC_SEQ_CST); return 0; }
CUresult cuModuleLoadData(void** m, const void* image) {
    if (env_on("FAKE_CUDA_NO_GATHER") || !strstr((const char*)image, ".visible .entry ckpt_gather(")) return 218;
    *m = &g_ctx_token;
    __atomic_add_fetch(&g_modules, 1, __ATOMIC_SEQ_CST);
    return 0;
}
CUresult cuModuleUnload(void* m) { (void)m; __atomic_sub_fetch(&g_modules, 1, __ATOMIC_SEQ_CST); return 0; }
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
    (void)m;
    if (fails("cuModuleGetFunction")) return 2;
    *f = &g_ctx_token;
    return strcmp(name, "ckpt_gather") ? 500 : 0;
}
CUresult cuFuncGetAttribute(int* v, int a, void* f) { (void)a; (void)f; *v = 1024; return 0; }
CUresult cuFuncLoad(void* f) { (void)f; return fails("cuFuncLoad") ? 2 : 0; }
/* The gather kernel's contract: descs[c] = {src, dst, n} for c < count. */
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void* s, void** params, void** extra) {
    (void)f; (void)gy; (void)gz; (void)by; (void)bz; (void)shm; (void)s; (void)extra;
    if (!gx || bx != 256) return 1;
    const unsigned long long* d = (const unsigned long long*)(uintptr_t)*(unsigned long long*)params[0];
    unsigned long long count = *(unsigned long long*)params[1];
    for (unsigned long long c = 0; c < count; ++c)
        memcpy((void*)(uintptr_t)d[3 * c + 1], (const void*)(uintptr_t)d[3 * c], d[3 * c + 2]);
    __atomic_add_fetch(&g_launches, 1, __ATOMIC_SEQ_CST);
    return 0;
}
