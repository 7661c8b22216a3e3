// Probe for issue 25, not the product: a shadow libnvidia-ml.so.1 that reports the container's
// memory (GPU_MPS_SLICE_MEMORY_BYTES) as the device's total; everything else is the real NVML,
// a dependency by absolute path (REAL_NVML).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

#ifndef REAL_NVML
#error "REAL_NVML: the absolute path the real libnvidia-ml is reached at"
#endif

typedef struct { unsigned long long total, free, used; } nvml_memory;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvml_memory_v2;

static void *real_symbol(const char *name) {
    static void *real;
    if (!real) real = dlopen(REAL_NVML, RTLD_LAZY | RTLD_NOLOAD);
    if (!real) real = dlopen(REAL_NVML, RTLD_LAZY);
    return real ? dlsym(real, name) : NULL;
}

static unsigned long long slice_bytes(void) {
    const char *v = getenv("GPU_MPS_SLICE_MEMORY_BYTES");
    return v ? strtoull(v, NULL, 10) : 0;
}

int nvmlDeviceGetMemoryInfo(void *device, nvml_memory *m) {
    int (*real)(void *, nvml_memory *) = (int (*)(void *, nvml_memory *))real_symbol("nvmlDeviceGetMemoryInfo");
    if (!real) return 999;
    int r = real(device, m);
    unsigned long long slice = slice_bytes();
    if (r == 0 && slice) {
        m->total = slice;
        if (m->free > slice) m->free = slice;
        m->used = slice - m->free;
    }
    return r;
}

int nvmlDeviceGetMemoryInfo_v2(void *device, nvml_memory_v2 *m) {
    int (*real)(void *, nvml_memory_v2 *) = (int (*)(void *, nvml_memory_v2 *))real_symbol("nvmlDeviceGetMemoryInfo_v2");
    if (!real) return 999;
    int r = real(device, m);
    unsigned long long slice = slice_bytes();
    if (r == 0 && slice) {
        m->total = slice;
        m->reserved = 0;
        if (m->free > slice) m->free = slice;
        m->used = slice - m->free;
    }
    return r;
}
