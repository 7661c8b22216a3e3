// A program linked against the driver itself (-lcuda: libcuda.so.1 is its DT_NEEDED).
#include <stdio.h>
#include <stddef.h>
int cuInit(unsigned);
int cuDeviceGet(int *, int);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuMemGetInfo_v2(size_t *, size_t *);
int cuDeviceTotalMem_v2(size_t *, int);
int main(void) {
    int dev = 0; void *ctx = 0; size_t f = 0, t = 0, dt = 0;
    int r = cuInit(0);
    if (!r) r = cuDeviceGet(&dev, 0);
    if (!r) r = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!r) r = cuCtxSetCurrent(ctx);
    if (!r) r = cuMemGetInfo_v2(&f, &t);
    if (!r) r = cuDeviceTotalMem_v2(&dt, dev);
    printf("{\"route\":\"linked -lcuda\",\"ok\":%s,\"free_mib\":%zu,\"total_mib\":%zu,\"device_total_mib\":%zu}\n",
           r ? "false" : "true", f >> 20, t >> 20, dt >> 20);
    return r;
}
