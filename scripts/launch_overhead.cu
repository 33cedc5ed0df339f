// Per-kernel launch cost on one GPU, with and without CUDA graphs (issue 21 item 6): the figures
// behind the GPU presets' `node_overhead_s` / `step_overhead_s` (src/planner/presets.rs).
// Build and run: nvcc -O2 -o /tmp/lo scripts/launch_overhead.cu && /tmp/lo
// Prints one JSON object; times are medians of 7 repetitions, in microseconds.
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

__global__ void tiny(float *x) {
    if (threadIdx.x == 0) x[0] += 1.0f;
}

#define CK(e) do { cudaError_t r = (e); if (r != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #e, cudaGetErrorString(r)); return 1; } } while (0)

static double now_us() {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}
static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    const int N = 2000, REPS = 7, GRAPH_RUNS = 20, RT = 2000;
    float *x;
    cudaStream_t s;
    CK(cudaMalloc(&x, 4));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int i = 0; i < 1000; i++) tiny<<<1, 32, 0, s>>>(x);
    CK(cudaStreamSynchronize(s));

    // 1. Back-to-back launches on a stream, one synchronization at the end.
    std::vector<double> eager;
    for (int r = 0; r < REPS; r++) {
        double t0 = now_us();
        for (int i = 0; i < N; i++) tiny<<<1, 32, 0, s>>>(x);
        CK(cudaStreamSynchronize(s));
        eager.push_back((now_us() - t0) / N);
    }
    // 2. Launch then synchronize, each time: a launch round trip.
    std::vector<double> round;
    for (int r = 0; r < REPS; r++) {
        double t0 = now_us();
        for (int i = 0; i < RT; i++) { tiny<<<1, 32, 0, s>>>(x); cudaStreamSynchronize(s); }
        round.push_back((now_us() - t0) / RT);
    }
    // 3. The same N kernels captured in one graph, replayed.
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < N; i++) tiny<<<1, 32, 0, s>>>(x);
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    std::vector<double> graph;
    for (int r = 0; r < REPS; r++) {
        double t0 = now_us();
        for (int k = 0; k < GRAPH_RUNS; k++) CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        graph.push_back((now_us() - t0) / (double(N) * GRAPH_RUNS));
    }
    // 4. A one-kernel graph launched and synchronized each time: a graph round trip.
    cudaGraph_t g1;
    cudaGraphExec_t ge1;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    tiny<<<1, 32, 0, s>>>(x);
    CK(cudaStreamEndCapture(s, &g1));
    CK(cudaGraphInstantiate(&ge1, g1, 0));
    std::vector<double> ground;
    for (int r = 0; r < REPS; r++) {
        double t0 = now_us();
        for (int i = 0; i < RT; i++) { cudaGraphLaunch(ge1, s); cudaStreamSynchronize(s); }
        ground.push_back((now_us() - t0) / RT);
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    printf("{\"device\": \"%s\", \"driver\": %d, \"runtime\": %d, \"kernels\": %d,\n"
           " \"eager_us_per_kernel\": %.3f, \"launch_sync_round_trip_us\": %.3f,\n"
           " \"graph_us_per_kernel\": %.3f, \"graph_launch_sync_round_trip_us\": %.3f}\n",
           p.name, drv, rt, N, median(eager), median(round), median(graph), median(ground));
    return 0;
}
