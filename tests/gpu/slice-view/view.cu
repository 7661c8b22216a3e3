// What CUDA reports through the runtime (nvcc links cudart statically by default; the probe also
// builds it with -cudart shared -DROUTE=\"cudart-shared\").
#ifndef ROUTE
#define ROUTE "cudart-static"
#endif
#include <cstdio>
#include <cuda_runtime.h>
int main() {
    size_t free_b = 0, total_b = 0;
    cudaError_t e = cudaSetDevice(0);
    if (e == cudaSuccess) e = cudaMemGetInfo(&free_b, &total_b);
    cudaDeviceProp p{};
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&p, 0);
    void *buf = nullptr;
    size_t free_after = 0, total_after = 0;
    cudaError_t a = cudaMalloc(&buf, 1ull << 30);
    cudaMemGetInfo(&free_after, &total_after);
    printf("{\"route\":\"" ROUTE "\",\"ok\":%s,\"error\":\"%s\",\"free_mib\":%zu,\"total_mib\":%zu,"
           "\"prop_total_mib\":%zu,\"alloc_1g\":%s,\"free_after_mib\":%zu}\n",
           e == cudaSuccess ? "true" : "false", cudaGetErrorString(e), free_b >> 20, total_b >> 20,
           (size_t)p.totalGlobalMem >> 20, a == cudaSuccess ? "true" : "false", free_after >> 20);
    return e == cudaSuccess ? 0 : 1;
}
