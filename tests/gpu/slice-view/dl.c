// The driver reached without cudart: dlopen of libcuda.so / libcuda.so.1, dlsym, and
#define _GNU_SOURCE
// cuGetProcAddress (v1 and v2), as Go, Rust (cudarc loads libcuda.so first) and JAX's plugins do.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
typedef int (*init_fn)(unsigned);
typedef int (*dev_get_fn)(int *, int);
typedef int (*retain_fn)(void **, int);
typedef int (*set_fn)(void *);
typedef int (*info_fn)(size_t *, size_t *);
typedef int (*total_fn)(size_t *, int);
typedef int (*proc1_fn)(const char *, void **, int, uint64_t);
typedef int (*proc2_fn)(const char *, void **, int, uint64_t, int *);
int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "libcuda.so.1";
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!h) { printf("{\"route\":\"dlopen %s\",\"ok\":false,\"error\":\"%s\"}\n", name, dlerror()); return 1; }
    init_fn init = (init_fn)dlsym(h, "cuInit");
    dev_get_fn dev_get = (dev_get_fn)dlsym(h, "cuDeviceGet");
    retain_fn retain = (retain_fn)dlsym(h, "cuDevicePrimaryCtxRetain");
    set_fn set = (set_fn)dlsym(h, "cuCtxSetCurrent");
    info_fn info = (info_fn)dlsym(h, "cuMemGetInfo_v2");
    total_fn total = (total_fn)dlsym(h, "cuDeviceTotalMem_v2");
    proc1_fn p1 = (proc1_fn)dlsym(h, "cuGetProcAddress");
    proc2_fn p2 = (proc2_fn)dlsym(h, "cuGetProcAddress_v2");
    void *launch = dlsym(h, "cuLaunchKernel");
    Dl_info where = {0};
    dladdr((void *)info, &where);
    int dev = 0; void *ctx = 0;
    int r = init ? init(0) : -1;
    if (!r) r = dev_get(&dev, 0);
    if (!r) r = retain(&ctx, dev);
    if (!r) r = set(ctx);
    size_t f = 0, t = 0, dt = 0, pf = 0, pt = 0, pdt = 0;
    int ri = r ? r : info(&f, &t);
    int rt = r ? r : total(&dt, dev);
    void *via = 0; int status = 0;
    int rp2 = p2 ? p2("cuMemGetInfo", &via, 12000, 0, &status) : -1;
    if (!rp2 && via) ((info_fn)via)(&pf, &pt);
    void *via_t = 0;
    int rp1 = p1 ? p1("cuDeviceTotalMem", &via_t, 12000, 0) : -1;
    if (!rp1 && via_t) ((total_fn)via_t)(&pdt, dev);
    printf("{\"route\":\"dlopen %s\",\"ok\":%s,\"init\":%d,\"info_from\":\"%s\",\"launch_found\":%s,"
           "\"free_mib\":%zu,\"total_mib\":%zu,\"device_total_mib\":%zu,"
           "\"procaddr_v2_total_mib\":%zu,\"procaddr_v1_device_total_mib\":%zu}\n",
           name, (!r && !ri && !rt) ? "true" : "false", r, where.dli_fname ? where.dli_fname : "?",
           launch ? "true" : "false", f >> 20, t >> 20, dt >> 20, pt >> 20, pdt >> 20);
    return 0;
}
