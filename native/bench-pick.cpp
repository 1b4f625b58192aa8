// bench-pick: the candidate choice of a denoising step (per row: the token and its probability)
// with GGML_OP_GUMBEL_ARGMAX (patches/0002) against compositions of existing ggml ops, on the
// CPU backend. Prints one line per variant: median and spread (min, max) of the wall time.
//
//   bench-pick [n_vocab] [n_rows] [n_threads] [reps]
//
// greedy:  gumbel_argmax(T = 0)  vs  add(mask bias) -> argmax, soft_max -> pool_1d(max)
// sampled: gumbel_argmax(T = 1)  vs  the same draw with the noise made on the host and uploaded
//          (add(noise) -> argmax, soft_max, the probability read back per row), and vs
//          inverse-CDF (soft_max -> cumsum -> sub(uniform per row) -> step -> sum_rows: another draw)

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "noise.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

using clk = std::chrono::steady_clock;

struct variant {
    const char * name;
    // builds the graph's outputs into gf; host_pre / host_post: the host work before and after compute
    std::function<void(ggml_context *, ggml_cgraph *, ggml_tensor * a)> build;
    std::function<void()> host_pre;
    std::function<void()> host_post;
};

static double ms_since(clk::time_point t0) {
    return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}

int main(int argc, char ** argv) {
    const int64_t V    = argc > 1 ? atoll(argv[1]) : 248320;
    const int64_t R    = argc > 2 ? atoll(argv[2]) : 32;
    const int     nth  = argc > 3 ? atoi(argv[3]) : 2;
    const int     reps = argc > 4 ? atoi(argv[4]) : 20;
    const int32_t mask = (int32_t) (V - 1);

    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, nth);

    std::vector<float> logits((size_t) V * R), bias(V, 0.0f), noise((size_t) V * R), uni(R);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 4.0f);
    for (auto & x : logits) {
        x = nd(rng);
    }
    bias[mask] = -INFINITY;
    std::vector<int32_t> keys(2 * R);
    for (auto & k : keys) {
        k = (int32_t) rng();
    }

    ggml_tensor * t_idx = nullptr; // the outputs the host reads back
    ggml_tensor * t_p   = nullptr;
    ggml_tensor * t_noise = nullptr, * t_uni = nullptr, * t_bias = nullptr, * t_keys = nullptr;
    std::vector<int32_t> idx(R);
    std::vector<float>   pk(2 * R), cnt(R), prob(R);

    auto masked = [&](ggml_context * ctx, ggml_tensor * a) {
        t_bias = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, V);
        ggml_set_input(t_bias);
        return ggml_add(ctx, a, t_bias);
    };
    auto read_prob = [&]() { // one float per row at the chosen column
        for (int64_t r = 0; r < R; ++r) {
            ggml_backend_tensor_get(t_p, &prob[r], ((size_t) r * V + idx[r]) * sizeof(float), sizeof(float));
        }
    };
    auto op = [&](float T) {
        return [&, T](ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * a) {
            t_keys = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 2, R);
            ggml_set_input(t_keys);
            t_p = ggml_gumbel_argmax(ctx, a, t_keys, mask, T);
            ggml_build_forward_expand(gf, t_p);
        };
    };
    std::vector<variant> vars = {
        { "greedy  gumbel_argmax op", op(0.0f), nullptr, [&]() { ggml_backend_tensor_get(t_p, pk.data(), 0, pk.size() * 4); } },
        { "greedy  argmax + soft_max + pool_1d(max)",
          [&](ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * a) {
              ggml_tensor * m = masked(ctx, a);
              t_idx = ggml_argmax(ctx, m);
              t_p   = ggml_pool_1d(ctx, ggml_soft_max(ctx, m), GGML_OP_POOL_MAX, (int) V, (int) V, 0);
              ggml_build_forward_expand(gf, t_idx);
              ggml_build_forward_expand(gf, t_p);
          },
          nullptr,
          [&]() {
              ggml_backend_tensor_get(t_idx, idx.data(), 0, idx.size() * 4);
              ggml_backend_tensor_get(t_p, prob.data(), 0, prob.size() * 4);
          } },
        { "sampled gumbel_argmax op", op(1.0f), nullptr, [&]() { ggml_backend_tensor_get(t_p, pk.data(), 0, pk.size() * 4); } },
        { "sampled host noise + add + argmax + soft_max",
          [&](ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * a) {
              ggml_tensor * m = masked(ctx, a);
              t_noise = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, V, R);
              ggml_set_input(t_noise);
              t_idx = ggml_argmax(ctx, ggml_add(ctx, m, t_noise));
              t_p   = ggml_soft_max(ctx, m);
              ggml_build_forward_expand(gf, t_idx);
              ggml_build_forward_expand(gf, t_p);
          },
          [&]() { // the same noise as the op draws, made on the host and uploaded
              for (int64_t r = 0; r < R; ++r) {
                  const uint64_t key = (uint32_t) keys[2 * r] | ((uint64_t) (uint32_t) keys[2 * r + 1] << 32);
                  for (int64_t c = 0; c < V; ++c) {
                      noise[(size_t) r * V + c] = (float) clover_gumbel_noise(key, c);
                  }
              }
              ggml_backend_tensor_set(t_noise, noise.data(), 0, noise.size() * 4);
          },
          [&]() {
              ggml_backend_tensor_get(t_idx, idx.data(), 0, idx.size() * 4);
              read_prob();
          } },
        { "sampled inverse-CDF: soft_max + cumsum + step + sum_rows",
          [&](ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * a) {
              t_p   = ggml_soft_max(ctx, masked(ctx, a));
              t_uni = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, R);
              ggml_set_input(t_uni);
              t_idx = ggml_sum_rows(ctx, ggml_step(ctx, ggml_sub(ctx, ggml_cumsum(ctx, t_p), t_uni)));
              ggml_build_forward_expand(gf, t_idx);
              ggml_build_forward_expand(gf, t_p);
          },
          [&]() {
              for (auto & u : uni) {
                  u = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
              }
              ggml_backend_tensor_set(t_uni, uni.data(), 0, uni.size() * 4);
          },
          [&]() {
              ggml_backend_tensor_get(t_idx, cnt.data(), 0, cnt.size() * 4);
              for (int64_t r = 0; r < R; ++r) {
                  idx[r] = (int32_t) std::clamp<float>((float) V - cnt[r], 0.0f, (float) V - 1);
              }
              read_prob();
          } },
    };

    printf("n_vocab %lld, rows %lld, threads %d, %d reps: median [min, max] ms per step\n", (long long) V, (long long) R, nth,
           reps);
    for (auto & v : vars) {
        ggml_init_params ip = { ggml_tensor_overhead() * 64 + ggml_graph_overhead(), nullptr, true };
        ggml_context * ctx = ggml_init(ip);
        ggml_cgraph *  gf  = ggml_new_graph(ctx);
        ggml_tensor *  a   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, V, R);
        ggml_set_input(a);
        t_bias = t_keys = nullptr;
        v.build(ctx, gf, a);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
        if (t_bias) {
            ggml_backend_tensor_set(t_bias, bias.data(), 0, bias.size() * 4);
        }
        if (t_keys) {
            ggml_backend_tensor_set(t_keys, keys.data(), 0, keys.size() * 4);
        }
        std::vector<double> ts;
        for (int i = 0; i < reps + 3; ++i) {
            ggml_backend_tensor_set(a, logits.data(), 0, logits.size() * 4);
            const auto t0 = clk::now();
            if (v.host_pre) {
                v.host_pre();
            }
            ggml_backend_graph_compute(be, gf);
            v.host_post();
            if (i >= 3) {
                ts.push_back(ms_since(t0));
            }
        }
        std::sort(ts.begin(), ts.end());
        printf("%-58s %8.3f [%.3f, %.3f]\n", v.name, ts[ts.size() / 2], ts.front(), ts.back());
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    ggml_backend_free(be);
    return 0;
}
