// Launch path cost: N empty kernel launches, then one sync; prints launches per second.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
__global__ void empty() {}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 200000;
    empty<<<1, 1>>>();
    if (cudaDeviceSynchronize() != cudaSuccess) { printf("{\"ok\":false}\n"); return 1; }
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; i++) empty<<<1, 1>>>();
    cudaDeviceSynchronize();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("{\"ok\":true,\"launches\":%d,\"seconds\":%.4f,\"per_launch_us\":%.3f}\n", n, s, s * 1e6 / n);
    return 0;
}
