// Probe for issue 25 (the slice view), not the product: a shadow libcuda.so.1 that reports the
// container's memory (GPU_MPS_SLICE_MEMORY_BYTES) as the device's total and forwards everything
// else to the real driver. It is linked with the real driver as a dependency by absolute path
// (REAL_CUDA below), so dlsym on its handle finds every symbol it does not define in the real one.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef REAL_CUDA
#error "REAL_CUDA: the absolute path the real libcuda is reached at"
#endif

typedef int CUresult;
typedef int CUdevice;
typedef int (*mem_info_v2_fn)(size_t *, size_t *);
typedef int (*mem_info_v1_fn)(unsigned int *, unsigned int *);
typedef int (*total_v2_fn)(size_t *, CUdevice);
typedef int (*total_v1_fn)(unsigned int *, CUdevice);
typedef int (*proc_v1_fn)(const char *, void **, int, uint64_t);
typedef int (*proc_v2_fn)(const char *, void **, int, uint64_t, void *);

static void *real_symbol(const char *name) {
    static void *real;
    if (!real) real = dlopen(REAL_CUDA, RTLD_LAZY | RTLD_NOLOAD);
    if (!real) real = dlopen(REAL_CUDA, RTLD_LAZY);
    return real ? dlsym(real, name) : NULL;
}

static size_t slice_bytes(void) {
    const char *v = getenv("GPU_MPS_SLICE_MEMORY_BYTES");
    return v ? (size_t)strtoull(v, NULL, 10) : 0;
}

static void fit(size_t *free_b, size_t *total_b) {
    size_t slice = slice_bytes();
    if (!slice) return;
    if (total_b) *total_b = slice;
    if (free_b && *free_b > slice) *free_b = slice;
}

CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    mem_info_v2_fn real = (mem_info_v2_fn)real_symbol("cuMemGetInfo_v2");
    if (!real) return 34; // CUDA_ERROR_STUB_LIBRARY
    CUresult r = real(free_b, total_b);
    if (r == 0) fit(free_b, total_b);
    return r;
}

CUresult cuMemGetInfo(unsigned int *free_b, unsigned int *total_b) {
    mem_info_v1_fn real = (mem_info_v1_fn)real_symbol("cuMemGetInfo");
    if (!real) return 34;
    CUresult r = real(free_b, total_b);
    size_t slice = slice_bytes();
    if (r == 0 && slice) {
        if (total_b) *total_b = slice > 0xffffffffu ? 0xffffffffu : (unsigned int)slice;
        if (free_b && *free_b > *total_b) *free_b = *total_b;
    }
    return r;
}

CUresult cuDeviceTotalMem_v2(size_t *total_b, CUdevice dev) {
    total_v2_fn real = (total_v2_fn)real_symbol("cuDeviceTotalMem_v2");
    if (!real) return 34;
    CUresult r = real(total_b, dev);
    if (r == 0) fit(NULL, total_b);
    return r;
}

CUresult cuDeviceTotalMem(unsigned int *total_b, CUdevice dev) {
    total_v1_fn real = (total_v1_fn)real_symbol("cuDeviceTotalMem");
    if (!real) return 34;
    CUresult r = real(total_b, dev);
    size_t slice = slice_bytes();
    if (r == 0 && slice && total_b) *total_b = slice > 0xffffffffu ? 0xffffffffu : (unsigned int)slice;
    return r;
}

CUresult cuGetProcAddress_v2(const char *, void **, int, uint64_t, void *);
CUresult cuGetProcAddress(const char *, void **, int, uint64_t);

// The real lookup answers with one version of an entry point; the wrapper of that same version
// replaces it, so a caller asking for an old ABI still gets the old ABI.
static void substitute(void **pfn) {
    static const char *names[][2] = {
        {"cuMemGetInfo_v2", (const char *)cuMemGetInfo_v2},
        {"cuMemGetInfo", (const char *)cuMemGetInfo},
        {"cuDeviceTotalMem_v2", (const char *)cuDeviceTotalMem_v2},
        {"cuDeviceTotalMem", (const char *)cuDeviceTotalMem},
        {"cuGetProcAddress_v2", (const char *)cuGetProcAddress_v2},
        {"cuGetProcAddress", (const char *)cuGetProcAddress},
    };
    if (!pfn || !*pfn) return;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*pfn == real_symbol(names[i][0])) { *pfn = (void *)names[i][1]; return; }
    }
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, void *status) {
    proc_v2_fn real = (proc_v2_fn)real_symbol("cuGetProcAddress_v2");
    if (!real) return 34;
    CUresult r = real(symbol, pfn, version, flags, status);
    if (r == 0) substitute(pfn);
    return r;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    proc_v1_fn real = (proc_v1_fn)real_symbol("cuGetProcAddress");
    if (!real) return 34;
    CUresult r = real(symbol, pfn, version, flags);
    if (r == 0) substitute(pfn);
    return r;
}
