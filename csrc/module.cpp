// Python bindings: ckptstore._C. Pointers and sizes arrive as Python ints, so
// the module does not depend on torch's C++ ABI. Arguments are checked with
// the GIL held; the work itself runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_ops.h"
#include "host_pool.h"
#include "ops.h"

namespace nb = nanobind;
using std::size_t;
using std::uintptr_t;

namespace {

// Raises ValueError (std::invalid_argument) unless [dst, dst+n) and
// [src, src+n) are non-null, do not wrap around and do not overlap.
void check_ranges(uintptr_t dst, uintptr_t src, size_t n, const char* what) {
    if (n == 0) return;
    auto fail = [&](const char* why) {
        throw std::invalid_argument(std::string(what) + ": " + why + " (dst=" +
                                    std::to_string(dst) + ", src=" + std::to_string(src) +
                                    ", nbytes=" + std::to_string(n) + ")");
    };
    if (dst == 0 || src == 0) fail("null pointer");
    if (n > UINTPTR_MAX - dst || n > UINTPTR_MAX - src) fail("range wraps around");
    if (dst < src + n && src < dst + n) fail("source and destination overlap");
}

// Buffer protocol of Block: a writable, 1-D unsigned-byte view of its memory.
// The view holds a reference to the Block, and the Block to its slab, so the
// memory outlives every memoryview / torch.frombuffer tensor made from it.
unsigned char g_empty[1];

int block_getbuffer(PyObject* self, Py_buffer* view, int flags) {
    auto* b = nb::inst_ptr<ckpt::Block>(self);
    void* p = b->nbytes ? reinterpret_cast<void*>(b->ptr) : static_cast<void*>(g_empty);
    return PyBuffer_FillInfo(view, self, p, static_cast<Py_ssize_t>(b->nbytes), 0, flags);
}

PyType_Slot g_block_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(block_getbuffer)},
                               {0, nullptr}};

nb::dict pool_stats_dict(const ckpt::PoolStats& s) {
    nb::dict d;
    d["capacity"] = s.capacity;
    d["held"] = s.held;
    d["in_use"] = s.in_use;
    d["used"] = s.used;
    d["cached"] = s.cached;
    d["peak"] = s.peak;
    d["peak_in_use"] = s.peak_in_use;
    d["overflow_bytes"] = s.overflow_bytes;
    d["largest_free"] = s.largest_free;
    d["slab_bytes"] = s.slab_bytes;
    d["alignment"] = s.alignment;
    d["slabs"] = s.slabs;
    d["pinned_slabs"] = s.pinned_slabs;
    d["live_blocks"] = s.live_blocks;
    d["allocs"] = s.allocs;
    d["slab_allocs"] = s.slab_allocs;
    d["slab_frees"] = s.slab_frees;
    d["overflow_allocs"] = s.overflow_allocs;
    d["pin_failures"] = s.pin_failures;
    d["fragmentation_fails"] = s.fragmentation_fails;
    d["reclaim_fails"] = s.reclaim_fails;
    d["reclaiming"] = s.reclaiming;
    d["quarantined"] = s.quarantined;
    d["pinned"] = s.pinned;
    d["pin_error"] = s.pin_error;
    return d;
}

// A bytes object filled in place, then handed out whole. The S3 writer copies appended
// bytes straight into the part it will upload (one copy, the GIL released for large
// ones), where queueing a copy of each append and joining a part made two. The object
// stays private until take(): nothing can see it change. The caller serialises its
// calls (the writer holds its lock); a call made while a copy runs raises.
class BytesPart {
public:
    explicit BytesPart(size_t capacity) : capacity_(capacity) {
        if (capacity > static_cast<size_t>(PY_SSIZE_T_MAX))
            throw std::invalid_argument("BytesPart: capacity too large");
        obj_ = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(capacity));
        if (!obj_) throw nb::python_error();
    }
    BytesPart(const BytesPart&) = delete;
    BytesPart& operator=(const BytesPart&) = delete;
    ~BytesPart() { Py_XDECREF(obj_); }  // (nanobind destroys instances with the GIL held)

    // Copies src[start:] into the free room, as much as fits; returns the bytes copied.
    size_t write(nb::handle src, size_t start) {
        check_usable("write");
        Py_buffer view;
        if (PyObject_GetBuffer(src.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
        struct Release {
            Py_buffer* v;
            ~Release() { PyBuffer_Release(v); }
        } release{&view};
        check_usable("write");  // (a __buffer__ method may have called take())
        const size_t len = static_cast<size_t>(view.len);
        if (start > len) throw std::invalid_argument("BytesPart.write: start beyond the source's end");
        const size_t n = std::min(len - start, capacity_ - size_);
        char* dst = PyBytes_AS_STRING(obj_) + size_;
        const char* from = static_cast<const char*>(view.buf) + start;
        if (n < kReleaseGilBytes) {
            std::memcpy(dst, from, n);
        } else {
            busy_ = true;
            {
                nb::gil_scoped_release nogil;
                std::memcpy(dst, from, n);
            }
            busy_ = false;
        }
        size_ += n;
        return n;
    }

    // The bytes written (the object itself, shrunk in place when not full). Once only.
    nb::bytes take() {
        check_usable("take");
        PyObject* out = obj_;
        obj_ = nullptr;
        if (size_ != capacity_ && _PyBytes_Resize(&out, static_cast<Py_ssize_t>(size_)) != 0)
            throw nb::python_error();  // (out is freed and NULL then)
        return nb::steal<nb::bytes>(out);
    }

    size_t size() const { return size_; }
    size_t capacity() const { return capacity_; }

private:
    // Below this a copy takes microseconds: giving the GIL up and waiting to get it back
    // (up to the switch interval, while the writer's lock is held) would cost more.
    static constexpr size_t kReleaseGilBytes = 256 << 10;

    void check_usable(const char* what) const {
        if (busy_) throw std::runtime_error(std::string("BytesPart.") + what + ": a copy into it is running");
        if (!obj_) throw std::runtime_error(std::string("BytesPart.") + what + ": the part was taken");
    }

    PyObject* obj_ = nullptr;
    size_t capacity_ = 0;
    size_t size_ = 0;
    bool busy_ = false;  // read and written with the GIL held
};

}  // namespace

NB_MODULE(_C, m) {
    m.doc() = "ckptstore native kernels (private; use ckptstore.native)";
    // Pools and batches held by module globals (the process runtime) are still
    // alive at interpreter exit; that is expected, not a reference leak.
    nb::set_leak_warnings(false);

    m.def("hardware_threads", &ckpt::hardware_threads,
          "Number of hardware threads (at least 1).");

    m.def(
        "parallel_copy",
        [](uintptr_t dst, uintptr_t src, size_t nbytes, unsigned threads) {
            check_ranges(dst, src, nbytes, "parallel_copy");
            nb::gil_scoped_release nogil;
            ckpt::parallel_copy(reinterpret_cast<void*>(dst),
                                reinterpret_cast<const void*>(src), nbytes, threads);
        },
        nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::arg("threads") = 0,
        "memcpy(dst, src, nbytes) split over a persistent thread pool "
        "(threads=0: default count; below 1 MiB per thread fewer threads are used).");

    m.def(
        "copy_many",
        [](const std::vector<uintptr_t>& dsts, const std::vector<uintptr_t>& srcs,
           const std::vector<size_t>& sizes, unsigned threads) {
            if (dsts.size() != srcs.size() || dsts.size() != sizes.size())
                throw std::invalid_argument("copy_many: dsts, srcs and sizes differ in length");
            for (size_t k = 0; k < sizes.size(); ++k)
                check_ranges(dsts[k], srcs[k], sizes[k],
                             ("copy_many[" + std::to_string(k) + "]").c_str());
            nb::gil_scoped_release nogil;
            ckpt::copy_many(dsts.data(), srcs.data(), sizes.data(), sizes.size(), threads);
        },
        nb::arg("dsts"), nb::arg("srcs"), nb::arg("sizes"), nb::arg("threads") = 0,
        "Copies sizes[k] bytes from srcs[k] to dsts[k] for every k in one call, "
        "balanced over the thread pool by bytes.");

    auto shuffle_like = [&m](const char* name, auto fn, const char* doc) {
        m.def(
            name,
            [name, fn](uintptr_t dst, uintptr_t src, size_t nbytes, size_t itemsize) {
                if (itemsize == 0)
                    throw std::invalid_argument(std::string(name) + ": itemsize must be >= 1");
                check_ranges(dst, src, nbytes, name);
                nb::gil_scoped_release nogil;
                fn(reinterpret_cast<std::uint8_t*>(dst),
                   reinterpret_cast<const std::uint8_t*>(src), nbytes, itemsize);
            },
            nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::arg("itemsize"), doc);
    };
    shuffle_like("shuffle", &ckpt::shuffle,
                 "Byte-plane shuffle (blosc): dst[j*n + i] = src[i*itemsize + j] for "
                 "n = nbytes // itemsize; the nbytes % itemsize trailing bytes are copied.");
    shuffle_like("unshuffle", &ckpt::unshuffle, "Exact inverse of shuffle.");

    // ---- host staging pool ------------------------------------------------------

    nb::class_<BytesPart>(m, "BytesPart",
                          "A bytes object of `capacity` bytes filled in place by write(), then "
                          "handed out by take() (private until then; callers serialise)")
        .def(nb::init<size_t>(), nb::arg("capacity"))
        .def("write", &BytesPart::write, nb::arg("src"), nb::arg("start") = 0,
             "Copy src[start:] (a C-contiguous buffer) into the free room, as much as fits "
             "(the GIL released for large copies); returns the bytes copied.")
        .def("take", &BytesPart::take,
             "The bytes written: the object itself, shrunk in place when not full. Once only.")
        .def_prop_ro("size", &BytesPart::size)
        .def_prop_ro("capacity", &BytesPart::capacity);

    nb::class_<ckpt::Block>(m, "Block", nb::type_slots(g_block_slots),
                            "Memory lent by a HostPool (buffer protocol: writable bytes). "
                            "Not constructible from Python.")
        .def_ro("ptr", &ckpt::Block::ptr)
        .def_ro("nbytes", &ckpt::Block::nbytes)
        .def_ro("span", &ckpt::Block::span, "bytes carved from the slab (nbytes rounded to the alignment)")
        .def_ro("offset", &ckpt::Block::offset)
        .def_ro("live", &ckpt::Block::live, "lent and not yet freed")
        .def_prop_ro("pinned", &ckpt::Block::pinned)
        .def_prop_ro("overflow", [](const ckpt::Block& b) { return static_cast<bool>(b.overflow); })
        .def("__len__", [](const ckpt::Block& b) { return b.nbytes; })
        .def("__repr__", [](const ckpt::Block& b) {
            return "<ckptstore._C.Block ptr=" + std::to_string(b.ptr) + " nbytes=" +
                   std::to_string(b.nbytes) + (b.live ? "" : " freed") + ">";
        });

    nb::class_<ckpt::HostPool>(m, "HostPool",
                               "Slabs of host memory (page-locked with CUDA), sub-allocated at exact "
                               "sizes, kept across saves. Thread-safe.")
        .def(nb::init<size_t, bool, int, size_t, size_t>(), nb::arg("capacity"),
             nb::arg("pinned") = false, nb::arg("device") = 0, nb::arg("slab_bytes") = size_t(64) << 20,
             nb::arg("alignment") = 64)
        .def(
            "try_alloc",
            [](ckpt::HostPool& p, size_t nbytes, bool overflow) -> std::optional<ckpt::Block> {
                ckpt::Block b;
                bool ok;
                {
                    nb::gil_scoped_release nogil;  // may page-lock a new slab
                    ok = p.try_alloc(nbytes, b, overflow);
                }
                if (!ok) return std::nullopt;
                return b;
            },
            nb::arg("nbytes"), nb::arg("overflow") = false,
            "A Block of exactly nbytes, or None at once when in_use + nbytes > capacity or "
            "fragmentation leaves no hole and no room for a slab (wait for a free, then try "
            "again). overflow=True: in that second case lend ordinary memory beyond the "
            "capacity instead.")
        .def("free", &ckpt::HostPool::free, nb::arg("block"),
             "Return a block (ValueError if freed twice or not from this pool).")
        .def("trim", &ckpt::HostPool::trim, nb::call_guard<nb::gil_scoped_release>(),
             "Free every slab that lends nothing (waits until they are freed); returns the bytes freed.")
        .def("wait_reclaimed", &ckpt::HostPool::wait_reclaimed, nb::arg("timeout") = -1.0,
             nb::call_guard<nb::gil_scoped_release>(),
             "Wait (GIL released) until no slab this pool dropped is waiting for the reclaimer "
             "thread to free it; timeout in seconds (< 0: none). True when none is.")
        .def_prop_ro("reclaiming", [](const ckpt::HostPool& p) { return p.stats().reclaiming; },
                     "bytes of dropped slabs not freed yet (still counted against the capacity)")
        .def_prop_ro("reclaim_fails", &ckpt::HostPool::reclaim_fails,
                     "try_allocs that failed only until dropped slabs are freed (then wait_reclaimed)")
        .def("warm", &ckpt::HostPool::warm, nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>(),
             "Make new slabs, their pages faulted in, until the pool holds at least "
             "min(nbytes, capacity) bytes; returns the bytes of the new slabs.")
        .def("stats", [](const ckpt::HostPool& p) { return pool_stats_dict(p.stats()); })
        .def_prop_ro("capacity", &ckpt::HostPool::capacity)
        .def_prop_ro("in_use", &ckpt::HostPool::in_use, "bytes lent (cheaper than stats())")
        .def_prop_ro("pinned", &ckpt::HostPool::pinning, "slabs are page-locked");

    // ---- CUDA ---------------------------------------------------------------------

    m.def(
        "cuda_info",
        [] {
            const ckpt::CudaInfo& i = ckpt::cuda_info();
            nb::dict d;
            d["compiled"] = i.compiled;
            d["available"] = i.available;
            d["devices"] = i.devices;
            d["runtime_version"] = i.runtime_version;
            d["driver_version"] = i.driver_version;
            d["min_driver_version"] = i.min_driver_version;
            d["api"] = i.api;
            d["library"] = i.library;
            d["kernel"] = i.kernel;
            d["error"] = i.error;
            return d;
        },
        "What the extension sees of the CUDA driver (probed once; never raises).");

    m.def(
        "cuda_prepare",
        [](int device) {
            ckpt::CudaDeviceInfo i;
            {
                nb::gil_scoped_release nogil;  // may retain a context and JIT the kernel
                i = ckpt::cuda_prepare(device);
            }
            nb::dict d;
            d["device"] = i.device;
            d["compute_capability"] = std::to_string(i.cc_major) + "." + std::to_string(i.cc_minor);
            d["gather"] = i.gather;
            d["gather_error"] = i.gather_error;
            return d;
        },
        nb::arg("device"),
        "Create the device's staging state now (stream, events, the gather kernel loaded): "
        "what cuda_stage does on a device's first use, outside a save.");

    m.def("cuda_current_device", &ckpt::cuda_current_device,
          "The device of the calling thread's current CUDA context, or -1 when it has none "
          "(creates nothing).");

    m.def("gather_ptx", [] { return std::string(ckpt::gather_ptx()); },
          "The gather kernel's PTX as embedded (from csrc/gather.ptx; empty without the CUDA path).");

    m.def("quarantine_host_range", &ckpt::quarantine_host_range, nb::arg("ptr"), nb::arg("nbytes"),
          "Withhold host memory from reuse by every HostPool (what a timed-out CUDA copy does "
          "to its destinations); for tests.");

    m.def(
        "flush_reclaims", [] { ckpt::flush_reclaims(); }, nb::call_guard<nb::gil_scoped_release>(),
        "Wait until the reclaimer thread has freed every slab handed to it so far.");

    nb::class_<ckpt::CudaBatch>(m, "CudaBatch", "A batch of device-to-host copies in flight.")
        .def("wait", &ckpt::CudaBatch::wait, nb::call_guard<nb::gil_scoped_release>(),
             "Block until every copy has landed (GIL released); raises RuntimeError on a CUDA error "
             "or when the batch's timeout passes first.")
        .def("query", &ckpt::CudaBatch::query, nb::call_guard<nb::gil_scoped_release>(),
             "True once every copy has landed.")
        .def_ro("device", &ckpt::CudaBatch::device)
        .def_ro("count", &ckpt::CudaBatch::count)
        .def_ro("nbytes", &ckpt::CudaBatch::nbytes)
        .def_ro("gathered", &ckpt::CudaBatch::gathered)
        .def_ro("gathered_bytes", &ckpt::CudaBatch::gathered_bytes)
        .def_ro("timeout", &ckpt::CudaBatch::timeout)
        .def_prop_ro("finished", [](const ckpt::CudaBatch& b) { return b.finished.load(); });

    m.def(
        "cuda_stage",
        [](int device, uintptr_t stream, const std::vector<uintptr_t>& srcs,
           const std::vector<uintptr_t>& dsts, const std::vector<size_t>& sizes, size_t small_bytes,
           bool gather, double timeout) {
            if (srcs.size() != dsts.size() || srcs.size() != sizes.size())
                throw std::invalid_argument("cuda_stage: srcs, dsts and sizes differ in length");
            std::vector<ckpt::CopySpec> copies(srcs.size());
            for (size_t k = 0; k < srcs.size(); ++k) copies[k] = {srcs[k], dsts[k], sizes[k]};
            nb::gil_scoped_release nogil;
            return ckpt::cuda_stage(device, stream, copies.data(), copies.size(), small_bytes, gather,
                                    timeout);
        },
        nb::arg("device"), nb::arg("stream"), nb::arg("srcs"), nb::arg("dsts"), nb::arg("sizes"),
        nb::arg("small_bytes") = size_t(64) << 10, nb::arg("gather") = true, nb::arg("timeout") = 0.0,
        "Enqueue copies srcs[k] (device memory of `device`) -> dsts[k] (host) of sizes[k] bytes on "
        "the device's staging stream, ordered after the work enqueued so far on `stream` (a "
        "cudaStream_t as int); returns a CudaBatch at once. timeout > 0: its wait() fails after "
        "that many seconds instead of blocking for ever.");
}
