// ggml's CPU flash attention alone, on SmolLM2-135M's shapes (9 query heads sharing 3 KV heads,
// 64 dimensions, f16 K/V cache, causal mask), random data: is a query row's output the same
// bit for bit however it is batched, and what does a call cost?
//
//   fa_kernel exact T THREADS   evaluates a T-token prompt whole (ubatches of 512), then as a
//                               cached prefix + a suffix of 500, 65, 64, 63, 7 and 1 rows (on
//                               THREADS, 1 and 3 threads, KV view padded as llama.cpp pads it
//                               and 256 cells longer) and single rows alone; each output must
//                               equal the whole prompt's; also the error against an attention
//                               computed in double, and a hash of the whole prompt's output
//                               (equal across builds whose kernels round alike). Exits 1 when any
//                               batching differs.
//   fa_kernel time N_KV ROWS THREADS REPS
//                               CPU and wall time of one call: ROWS query rows (the last ones)
//                               over N_KV cells, mean of REPS calls.
//
// GGML_CPU_FA_BATCH_INVARIANT=1 selects the batch-invariant kernel of
// patches/llama.cpp/0001-fa-batch-invariant.patch. Built against a llama.cpp build tree:
//   g++ -O2 -std=c++17 -I LLAMA/ggml/include scripts/fa_kernel.cpp BUILD/ggml/src/libggml.a
//       BUILD/ggml/src/libggml-cpu.a BUILD/ggml/src/libggml-base.a -fopenmp -o fa_kernel
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

static const int D = 64, HQ = 9, HKV = 3;

struct Data {
    int                      kv_size;
    std::vector<ggml_fp16_t> k, v;  // [kv_size][HKV * D], as llama.cpp's K and V caches
    std::vector<float>       q;     // [T][HQ * D]
};

static double now_ms(clockid_t clock) {
    timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int padded_view(int cells) { return std::max(256, (cells + 255) / 256 * 256); }

// Attention output ([rows][HQ][D]) of query rows [a, b) (row i at position i) over a KV view of
// n_kv cells; reps > 0 also times that many calls.
static std::vector<float> attend(const Data & d, int a, int b, int n_kv, int threads, int reps, double * cpu_ms,
                                 double * wall_ms) {
    const int        n    = b - a;
    const size_t     size = (size_t) 16 * 1024 * 1024 + (size_t) d.kv_size * HKV * D * 4 + (size_t) n * n_kv * 2 +
                        (size_t) n * HQ * D * 8;
    ggml_init_params params = { size, nullptr, false };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    kc     = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, HKV * D, d.kv_size);
    ggml_tensor *    vc     = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, HKV * D, d.kv_size);
    memcpy(kc->data, d.k.data(), ggml_nbytes(kc));
    memcpy(vc->data, d.v.data(), ggml_nbytes(vc));
    ggml_tensor * k  = ggml_view_3d(ctx, kc, D, n_kv, HKV, kc->nb[1], D * sizeof(ggml_fp16_t), 0);
    ggml_tensor * v  = ggml_view_3d(ctx, vc, D, n_kv, HKV, vc->nb[1], D * sizeof(ggml_fp16_t), 0);
    ggml_tensor * q0 = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, HQ, n);
    memcpy(q0->data, d.q.data() + (size_t) a * HQ * D, ggml_nbytes(q0));
    ggml_tensor * q    = ggml_permute(ctx, q0, 0, 2, 1, 3);
    ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n);
    for (int r = 0; r < n; r++) {
        ggml_fp16_t * row = (ggml_fp16_t *) mask->data + (size_t) r * n_kv;
        for (int c = 0; c < n_kv; c++) {
            row[c] = ggml_fp32_to_fp16(c <= a + r ? 0.0f : -INFINITY);
        }
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / std::sqrt((float) D), 0.0f, 0.0f);
    ggml_cgraph * gf  = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_cplan           plan = ggml_graph_plan(gf, threads, nullptr);
    std::vector<uint8_t> work(plan.work_size);
    plan.work_data = work.data();
    ggml_graph_compute(gf, &plan);
    if (reps > 0) {
        const double cpu0 = now_ms(CLOCK_PROCESS_CPUTIME_ID), wall0 = now_ms(CLOCK_MONOTONIC);
        for (int i = 0; i < reps; i++) {
            ggml_graph_compute(gf, &plan);
        }
        *cpu_ms  = (now_ms(CLOCK_PROCESS_CPUTIME_ID) - cpu0) / reps;
        *wall_ms = (now_ms(CLOCK_MONOTONIC) - wall0) / reps;
    }
    std::vector<float> result((const float *) out->data, (const float *) out->data + (size_t) n * HQ * D);
    ggml_free(ctx);
    return result;
}

static Data random_data(int tokens, int kv_size) {
    Data                            d;
    std::mt19937                    gen(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    d.kv_size = kv_size;
    d.k.resize((size_t) kv_size * HKV * D);
    d.v.resize(d.k.size());
    d.q.resize((size_t) tokens * HQ * D);
    for (auto & x : d.k) {
        x = ggml_fp32_to_fp16(2.0f * normal(gen));
    }
    for (auto & x : d.v) {
        x = ggml_fp32_to_fp16(normal(gen));
    }
    for (auto & x : d.q) {
        x = 2.0f * normal(gen);
    }
    return d;
}

// The largest difference between the outputs and an attention computed in double, over a few rows.
static double error_against_double(const Data & d, const std::vector<float> & out, int tokens) {
    const double scale = 1.0 / std::sqrt((double) D);
    double       worst = 0.0;
    for (int r = 0; r < tokens; r += tokens / 7 + 1) {
        for (int h = 0; h < HQ; h++) {
            const int           hk = h / (HQ / HKV);
            std::vector<double> w(r + 1);
            double              top = -INFINITY;
            for (int c = 0; c <= r; c++) {
                double dot = 0.0;
                for (int i = 0; i < D; i++) {
                    dot += (double) d.q[((size_t) r * HQ + h) * D + i] *
                           ggml_fp16_to_fp32(d.k[(size_t) c * HKV * D + hk * D + i]);
                }
                w[c] = dot * scale;
                top  = std::max(top, w[c]);
            }
            double sum = 0.0;
            for (auto & x : w) {
                x = std::exp(x - top);
                sum += x;
            }
            for (int i = 0; i < D; i++) {
                double o = 0.0;
                for (int c = 0; c <= r; c++) {
                    o += w[c] * ggml_fp16_to_fp32(d.v[(size_t) c * HKV * D + hk * D + i]);
                }
                worst = std::max(worst, std::fabs(o / sum - out[((size_t) r * HQ + h) * D + i]));
            }
        }
    }
    return worst;
}

static int exact(int tokens, int threads) {
    const Data         d = random_data(tokens, padded_view(tokens) + 256);
    std::vector<float> whole;
    for (int a = 0; a < tokens; a += 512) {
        const int b   = std::min(tokens, a + 512);
        auto      out = attend(d, a, b, padded_view(b), threads, 0, nullptr, nullptr);
        whole.insert(whole.end(), out.begin(), out.end());
    }
    printf("largest error against an attention in double: %.3g\n", error_against_double(d, whole, tokens));
    int differ = 0, checked = 0;
    auto same = [&](const std::vector<float> & out, int a) {
        checked++;
        return memcmp(out.data(), whole.data() + (size_t) a * HQ * D, out.size() * sizeof(float)) == 0;
    };
    for (int suffix : { 500, 65, 64, 63, 7, 1 }) {
        for (int th : { threads, 1, 3 }) {
            for (int longer : { 0, 256 }) {
                const int a = tokens - suffix, n_kv = padded_view(tokens) + longer;
                if (!same(attend(d, a, tokens, n_kv, th, 0, nullptr, nullptr), a)) {
                    differ++;
                    printf("prefix + %d rows, %d threads, %d cells: DIFFERS\n", suffix, th, n_kv);
                }
            }
        }
    }
    for (int r = 0; r < tokens; r += tokens / 13 + 1) {
        if (!same(attend(d, r, r + 1, padded_view(r + 1), threads, 0, nullptr, nullptr), r)) {
            differ++;
            printf("row %d alone: DIFFERS\n", r);
        }
    }
    unsigned long long hash = 1469598103934665603ULL;  // FNV-1a over the bits
    for (float f : whole) {
        unsigned bits;
        memcpy(&bits, &f, sizeof(bits));
        hash = (hash ^ bits) * 1099511628211ULL;
    }
    printf("whole prompt's output hash: %016llx\n", hash);
    printf("%d tokens: %d of %d batchings differ from the whole prompt\n", tokens, differ, checked);
    return differ ? 1 : 0;
}

int main(int argc, char ** argv) {
    ggml_cpu_init();
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "exact" && argc == 4) {
        return exact(atoi(argv[2]), atoi(argv[3]));
    }
    if (mode == "time" && argc == 6) {
        const int n_kv = atoi(argv[2]), rows = atoi(argv[3]), threads = atoi(argv[4]), reps = atoi(argv[5]);
        double    cpu_ms, wall_ms;
        attend(random_data(n_kv, n_kv), n_kv - rows, n_kv, n_kv, threads, reps, &cpu_ms, &wall_ms);
        printf("%d rows over %d cells, %d threads: %.1f us CPU, %.1f us wall per call\n", rows, n_kv, threads,
               1e3 * cpu_ms, 1e3 * wall_ms);
        return 0;
    }
    fprintf(stderr, "usage: fa_kernel exact T THREADS | fa_kernel time N_KV ROWS THREADS REPS\n");
    return 2;
}
