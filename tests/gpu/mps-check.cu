// mps-check: a tiny CUDA client that reports what the GPU looks like from where it runs.
// Built on the GPU machine by tests/gpu/run.sh (nvcc, static cudart: the container needs only
// libcuda from the driver). It prints ONE JSON line on stdout, so the harness can parse it.
//
//   mps-check [--alloc-mib N]... [--hold-seconds S] [--busy-seconds S] [--tag T]
//
//   --alloc-mib N     try cudaMalloc(N MiB), record ok/fail, free it again (repeatable)
//   --hold-seconds S  keep the CUDA context open S seconds after the checks (to overlap clients)
//   --busy-seconds S  run a compute kernel for S seconds and report kernel launches per second
//   --tag T           copied into the output, to tell clients apart
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

__global__ void spin(float *out, int iters) {
    float x = threadIdx.x * 0.001f;
    for (int i = 0; i < iters; i++) x = x * 0.999f + 0.001f;
    if (x == 12345.0f) out[0] = x;  // keeps the loop alive
}

static std::string json_escape(const char *s) {
    std::string r;
    for (; s && *s; s++) {
        if (*s == '"' || *s == '\\') r += '\\';
        if ((unsigned char)*s >= 0x20) r += *s;
    }
    return r;
}

int main(int argc, char **argv) {
    std::vector<long> allocs;
    double hold = 0, busy = 0;
    const char *tag = "";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--alloc-mib") && i + 1 < argc) allocs.push_back(atol(argv[++i]));
        else if (!strcmp(argv[i], "--hold-seconds") && i + 1 < argc) hold = atof(argv[++i]);
        else if (!strcmp(argv[i], "--busy-seconds") && i + 1 < argc) busy = atof(argv[++i]);
        else if (!strcmp(argv[i], "--tag") && i + 1 < argc) tag = argv[++i];
        else { fprintf(stderr, "mps-check: unknown argument %s\n", argv[i]); return 2; }
    }
    auto t0 = std::chrono::steady_clock::now();
    cudaError_t err = cudaFree(0);  // creates the context: under MPS, this is the connect
    double init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (err != cudaSuccess) {
        printf("{\"tag\":\"%s\",\"pid\":%d,\"ok\":false,\"error\":\"%s\",\"init_s\":%.3f}\n", tag, getpid(),
               json_escape(cudaGetErrorString(err)).c_str(), init_s);
        return 1;
    }
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    std::string alloc_json;
    for (long mib : allocs) {
        void *p = nullptr;
        cudaError_t e = cudaMalloc(&p, (size_t)mib << 20);
        if (e == cudaSuccess) cudaFree(p);
        else cudaGetLastError();  // clear the sticky-free error state for the next try
        char buf[96];
        snprintf(buf, sizeof buf, "%s{\"mib\":%ld,\"ok\":%s}", alloc_json.empty() ? "" : ",", mib,
                 e == cudaSuccess ? "true" : "false");
        alloc_json += buf;
    }
    double launches_per_s = 0;
    if (busy > 0) {
        float *out;
        cudaMalloc(&out, 4);
        long n = 0;
        auto b0 = std::chrono::steady_clock::now();
        double el = 0;
        while (el < busy) {
            spin<<<sms * 4, 256>>>(out, 20000);
            cudaDeviceSynchronize();
            n++;
            el = std::chrono::duration<double>(std::chrono::steady_clock::now() - b0).count();
        }
        launches_per_s = n / el;
        cudaFree(out);
    }
    cudaError_t last = cudaGetLastError();
    const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
    const char *thr = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    const char *mem = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    printf("{\"tag\":\"%s\",\"pid\":%d,\"ok\":true,\"sms\":%d,\"free_mib\":%zu,\"total_mib\":%zu,"
           "\"init_s\":%.3f,\"allocs\":[%s],\"launches_per_s\":%.2f,\"last_error\":\"%s\","
           "\"env_pipe\":\"%s\",\"env_threads\":\"%s\",\"env_mem\":\"%s\"}\n",
           tag, getpid(), sms, free_b >> 20, total_b >> 20, init_s, alloc_json.c_str(), launches_per_s,
           json_escape(cudaGetErrorString(last)).c_str(), json_escape(pipe).c_str(), json_escape(thr).c_str(),
           json_escape(mem).c_str());
    fflush(stdout);
    if (hold > 0) std::this_thread::sleep_for(std::chrono::duration<double>(hold));
    return 0;
}
