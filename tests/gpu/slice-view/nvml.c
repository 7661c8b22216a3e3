// What NVML reports (nvidia-smi, DCGM, pynvml read the same library).
#include <dlfcn.h>
#include <stdio.h>
typedef struct { unsigned long long total, free, used; } mem1;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } mem2;
int main(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) { printf("{\"route\":\"nvml\",\"ok\":false,\"error\":\"%s\"}\n", dlerror()); return 1; }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    int (*m1)(void *, mem1 *) = (int (*)(void *, mem1 *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    int (*m2)(void *, mem2 *) = (int (*)(void *, mem2 *))dlsym(h, "nvmlDeviceGetMemoryInfo_v2");
    void *dev = 0; mem1 a = {0}; mem2 b = {0};
    b.version = (unsigned)sizeof(mem2) | (2u << 24);
    int r = init();
    if (!r) r = get(0, &dev);
    int r1 = r ? r : m1(dev, &a);
    int r2 = r ? r : m2(dev, &b);
    printf("{\"route\":\"nvml\",\"ok\":%s,\"v1_total_mib\":%llu,\"v1_used_mib\":%llu,\"v2_total_mib\":%llu,\"v2_used_mib\":%llu,\"r2\":%d}\n",
           (!r && !r1) ? "true" : "false", a.total >> 20, a.used >> 20, b.total >> 20, b.used >> 20, r2);
    return 0;
}
