// Python bindings: ckptstore._C. Pointers and sizes arrive as Python ints, so
// the module does not depend on torch's C++ ABI. Arguments are checked with
// the GIL held; the work itself runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

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

}  // namespace

NB_MODULE(_C, m) {
    m.doc() = "ckptstore native kernels (private; use ckptstore.native)";

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
}
