// mps-bench: the GPU workload of the proof suite (tests/gpu/proof.sh). ONE JSON line on stdout.
//
//   mps-bench matmul --n 1024 --seconds 5 [--start-at <unix seconds>] [--tag T]
//       A fixed-size bf16 matrix product (cuBLAS) in a loop, like a small inference step.
//       Starts at --start-at (so N containers start together), runs --seconds, reports
//       iterations/s and per-iteration latency p50 / p99 (each iteration synchronized).
//   mps-bench first-kernel [--t0-ns <CLOCK_REALTIME ns>]
//       Creates the context, runs one kernel, reports the time from --t0-ns (taken by the
//       harness just before `ctr run`) to the finished kernel: container create to first kernel.
//   mps-bench fill --mib M [--chunk-mib C] [--seconds S]
//       Allocates up to M MiB in chunks, reports how much it got, then runs kernels S seconds.
//   mps-bench fault [--after S]
//       Runs kernels, then after S seconds makes an illegal memory access; reports what happened.
//   mps-bench busy --seconds S
//       Runs kernels for S seconds, reporting every kernel error it sees (for fault neighbours).
//   mps-bench async-pool --mib M
//       cudaMallocAsync of M MiB from the default pool: does the MPS limit hold for pools?
//   mps-bench graph --mib M
//       A CUDA graph captured from a stream: an allocation node of M MiB, a kernel that writes
//       every page of it, a free node; instantiated and launched 3 times. Does the MPS limit hold
//       for graph memory, and at which stage does it fail?
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static long long realtime_ns() {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static const char *arg(int argc, char **argv, const char *name, const char *dflt) {
    for (int i = 2; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) return argv[i + 1];
    return dflt;
}

__global__ void spin(float *out, int iters) {
    float x = threadIdx.x * 0.001f;
    for (int i = 0; i < iters; i++) x = x * 0.999f + 0.001f;
    if (x == 12345.0f) out[0] = x;
}
__global__ void touch_pages(char *p, size_t bytes) {
    for (size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 4096; i < bytes;
         i += (size_t)gridDim.x * blockDim.x * 4096)
        p[i] = 1;
}
__global__ void poison(int *p) { p[threadIdx.x * 1000003LL] = 1; }
__global__ void init_bf16(__nv_bfloat16 *p, size_t n, unsigned seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) p[i] = __float2bfloat16((float)((i * 2654435761u + seed) % 1000) / 1000.0f - 0.5f);
}

static int sms_now() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    return sms;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: mps-bench matmul|first-kernel|fill|fault|busy|async-pool ...\n"); return 2; }
    std::string mode = argv[1];
    const char *tag = arg(argc, argv, "--tag", "");
    if (mode == "first-kernel") {
        long long t0 = atoll(arg(argc, argv, "--t0-ns", "0"));
        long long start = realtime_ns();
        float *out;
        cudaError_t e = cudaMalloc(&out, 4);
        long long ctx = realtime_ns();
        spin<<<1, 32>>>(out, 10);
        e = e != cudaSuccess ? e : cudaDeviceSynchronize();
        long long done = realtime_ns();
        printf("{\"tag\":\"%s\",\"ok\":%s,\"error\":\"%s\",\"sms\":%d,\"process_start_to_kernel_ms\":%.2f,"
               "\"context_ms\":%.2f,\"t0_to_kernel_ms\":%.2f}\n",
               tag, e == cudaSuccess ? "true" : "false", cudaGetErrorString(e), sms_now(), (done - start) / 1e6,
               (ctx - start) / 1e6, t0 ? (done - t0) / 1e6 : -1.0);
        return e == cudaSuccess ? 0 : 1;
    }
    cudaError_t e0 = cudaFree(0);
    if (e0 != cudaSuccess) {
        printf("{\"tag\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", tag, cudaGetErrorString(e0));
        return 1;
    }
    if (mode == "matmul") {
        int n = atoi(arg(argc, argv, "--n", "1024"));
        double seconds = atof(arg(argc, argv, "--seconds", "5"));
        double start_at = atof(arg(argc, argv, "--start-at", "0"));
        size_t elems = (size_t)n * n;
        __nv_bfloat16 *a, *b, *c;
        cudaMalloc(&a, elems * 2); cudaMalloc(&b, elems * 2); cudaMalloc(&c, elems * 2);
        init_bf16<<<(elems + 255) / 256, 256>>>(a, elems, 1);
        init_bf16<<<(elems + 255) / 256, 256>>>(b, elems, 2);
        cublasHandle_t h;
        cublasCreate(&h);
        float alpha = 1, beta = 0;
        auto gemm = [&] {
            return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                                &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        };
        for (int i = 0; i < 5; i++) gemm();  // warm-up: cuBLAS heuristics, module load
        cudaDeviceSynchronize();
        if (start_at > 0) {
            double wait = start_at - (double)realtime_ns() / 1e9;
            if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
        }
        std::vector<double> lat;
        lat.reserve(1 << 20);
        double t0 = now_s(), t = t0;
        cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
        while (t - t0 < seconds) {
            double s = now_s();
            st = gemm();
            cudaDeviceSynchronize();
            t = now_s();
            lat.push_back(t - s);
            if (st != CUBLAS_STATUS_SUCCESS) break;
        }
        std::sort(lat.begin(), lat.end());
        double el = t - t0;
        cudaError_t last = cudaGetLastError();
        printf("{\"tag\":\"%s\",\"ok\":%s,\"n\":%d,\"sms\":%d,\"iterations\":%zu,\"seconds\":%.3f,\"it_per_s\":%.1f,"
               "\"p50_ms\":%.4f,\"p99_ms\":%.4f,\"tflops\":%.2f,\"error\":\"%s\"}\n",
               tag, (st == CUBLAS_STATUS_SUCCESS && last == cudaSuccess) ? "true" : "false", n, sms_now(), lat.size(),
               el, lat.size() / el, lat[lat.size() / 2] * 1e3, lat[(lat.size() * 99) / 100] * 1e3,
               2.0 * n * (double)n * n * lat.size() / el / 1e12, cudaGetErrorString(last));
        return 0;
    }
    if (mode == "fill") {
        long mib = atol(arg(argc, argv, "--mib", "1024"));
        long chunk = atol(arg(argc, argv, "--chunk-mib", "256"));
        double seconds = atof(arg(argc, argv, "--seconds", "0"));
        long got = 0;
        std::vector<void *> ptrs;
        cudaError_t first_fail = cudaSuccess;
        // The context exists (main made it): what the limit leaves after it is what a fill can take.
        size_t free_before = 0, total_before = 0;
        cudaMemGetInfo(&free_before, &total_before);
        while (got + chunk <= mib) {
            void *p;
            cudaError_t e = cudaMalloc(&p, (size_t)chunk << 20);
            if (e != cudaSuccess) { first_fail = e; cudaGetLastError(); break; }
            cudaMemset(p, 1, (size_t)chunk << 20);
            ptrs.push_back(p);
            got += chunk;
        }
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        float *out;
        cudaMalloc(&out, 4);
        long launches = 0;
        int sms = sms_now();
        double t0 = now_s();
        cudaError_t ke = cudaSuccess;
        while (now_s() - t0 < seconds) {
            spin<<<sms * 2, 256>>>(out, 20000);
            ke = cudaDeviceSynchronize();
            if (ke != cudaSuccess) break;
            launches++;
        }
        printf("{\"tag\":\"%s\",\"ok\":%s,\"sms\":%d,\"asked_mib\":%ld,\"got_mib\":%ld,\"free_mib_before\":%zu,"
               "\"free_mib_after\":%zu,\"first_failure\":\"%s\",\"kernels\":%ld,\"kernel_error\":\"%s\"}\n",
               tag, ke == cudaSuccess ? "true" : "false", sms, mib, got,
               free_before >> 20, free_b >> 20, cudaGetErrorString(first_fail), launches, cudaGetErrorString(ke));
        return 0;
    }
    if (mode == "fault" || mode == "busy") {
        double seconds = atof(arg(argc, argv, "--seconds", "10"));
        double after = atof(arg(argc, argv, "--after", "2"));
        float *out;
        cudaMalloc(&out, 4);
        int sms = sms_now();
        double t0 = now_s();
        long launches = 0;
        cudaError_t e = cudaSuccess;
        double err_at = -1;
        while (now_s() - t0 < seconds) {
            if (mode == "fault" && now_s() - t0 >= after) {
                poison<<<1, 32>>>((int *)out);
                e = cudaDeviceSynchronize();
                err_at = now_s() - t0;
                break;
            }
            spin<<<sms * 2, 256>>>(out, 5000);
            e = cudaDeviceSynchronize();
            if (e != cudaSuccess) { err_at = now_s() - t0; break; }
            launches++;
        }
        printf("{\"tag\":\"%s\",\"mode\":\"%s\",\"ok\":%s,\"kernels\":%ld,\"error\":\"%s\",\"error_at_s\":%.3f,"
               "\"ran_s\":%.3f}\n",
               tag, mode.c_str(), e == cudaSuccess ? "true" : "false", launches, cudaGetErrorString(e), err_at,
               now_s() - t0);
        return e == cudaSuccess ? 0 : 3;
    }
    if (mode == "async-pool") {
        long mib = atol(arg(argc, argv, "--mib", "1024"));
        cudaStream_t s;
        cudaStreamCreate(&s);
        void *p = nullptr;
        cudaError_t e = cudaMallocAsync(&p, (size_t)mib << 20, s);
        cudaError_t se = cudaStreamSynchronize(s);
        printf("{\"tag\":\"%s\",\"ok\":%s,\"mib\":%ld,\"malloc_async\":\"%s\",\"sync\":\"%s\"}\n", tag,
               e == cudaSuccess && se == cudaSuccess ? "true" : "false", mib, cudaGetErrorString(e),
               cudaGetErrorString(se));
        return 0;
    }
    if (mode == "graph") {
        long mib = atol(arg(argc, argv, "--mib", "1024"));
        size_t bytes = (size_t)mib << 20;
        cudaStream_t s;
        cudaStreamCreate(&s);
        int nsm = sms_now();  // before the capture: only stream work belongs in it
        const char *stage = "capture";
        cudaGraph_t g = nullptr;
        cudaGraphExec_t ge = nullptr;
        void *p = nullptr;
        cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
        if (e == cudaSuccess) e = cudaMallocAsync(&p, bytes, s);
        if (e == cudaSuccess) {
            touch_pages<<<nsm * 4, 256, 0, s>>>((char *)p, bytes);
            e = cudaGetLastError();
        }
        if (e == cudaSuccess) e = cudaFreeAsync(p, s);
        cudaError_t end = cudaStreamEndCapture(s, &g);
        if (e == cudaSuccess) e = end;
        if (e == cudaSuccess) {
            stage = "instantiate";
            e = cudaGraphInstantiate(&ge, g, 0);
        }
        int launched = 0;
        for (int i = 0; i < 3 && e == cudaSuccess; i++) {
            stage = "launch";
            e = cudaGraphLaunch(ge, s);
            if (e == cudaSuccess) e = cudaStreamSynchronize(s);
            if (e == cudaSuccess) launched++;
        }
        printf("{\"tag\":\"%s\",\"ok\":%s,\"sms\":%d,\"mib\":%ld,\"stage\":\"%s\",\"launched\":%d,\"error\":\"%s\"}\n",
               tag, e == cudaSuccess ? "true" : "false", nsm, mib, e == cudaSuccess ? "done" : stage,
               launched, cudaGetErrorString(e));
        return 0;
    }
    fprintf(stderr, "mps-bench: unknown mode %s\n", mode.c_str());
    return 2;
}
