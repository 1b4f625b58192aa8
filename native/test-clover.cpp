// Clover (block diffusion) runtime checks against the spec's test vectors.
//
//   test-clover MODEL.gguf VECTORS.json [tolerance=1e-4]
//
// MODEL.gguf is the spec's random-clover test model converted to GGUF (float32 for the tolerance
// to hold), VECTORS.json is spec/vectors/vectors.json. Checks: block logits with empty memory,
// state after a 19-token prefill and denoise logits after it, a short block, greedy generation
// with the steps schedule, that a denoising step leaves the state bit-for-bit unchanged, and that
// the parallel (several blocks per graph) prefill equals the block-by-block one, and a bias sampler
// (llama.cpp's logit_bias and penalties samplers through clover_batch_set_bias).

#include "clover.h"
#include "llama.h"
#include "gguf.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <cstdlib>
#include <string>
#include <vector>

using json = nlohmann::json;

static int g_fail = 0;

static void report(const char * name, double err, double tol) {
    const bool ok = err <= tol;
    printf("%-40s max abs err %.3e  %s\n", name, err, ok ? "OK" : "FAIL");
    if (!ok) {
        g_fail++;
    }
}

static void check(const char * name, bool ok) {
    printf("%-40s %s\n", name, ok ? "OK" : "FAIL");
    if (!ok) {
        g_fail++;
    }
}

static std::vector<llama_token> toks(const json & j) {
    std::vector<llama_token> r;
    for (const auto & v : j) {
        r.push_back(v.get<int>());
    }
    return r;
}

static double max_err_2d(const std::vector<float> & got, const json & ref, int n_vocab) {
    double e = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        for (int v = 0; v < n_vocab; ++v) {
            e = std::max(e, (double) std::fabs(got[i*n_vocab + v] - ref[i][v].get<float>()));
        }
    }
    return e;
}

static void flatten(const json & j, std::vector<float> & out) {
    if (j.is_array()) {
        for (const auto & x : j) {
            flatten(x, out);
        }
    } else {
        out.push_back(j.get<float>());
    }
}

static std::vector<float> get_state(llama_context * ctx, int il) {
    const int32_t n = clover_get_state(ctx, il, nullptr, 0);
    std::vector<float> s(n);
    clover_get_state(ctx, il, s.data(), s.size());
    return s;
}


// malformed metadata must fail the load (nullptr), never abort: rewrite the model with one key changed
// copy of the model with one u32 key changed (val >= 0) or removed (val < 0); "" on failure
static std::string rewrite_model(const char * path, const char * key, int64_t val, const char * suffix) {
    gguf_init_params ip = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_context * g = gguf_init_from_file(path, ip);
    if (!g) {
        return "";
    }
    const size_t data_offset = gguf_get_data_offset(g);
    if (val < 0) {
        gguf_remove_key(g, key);
    } else {
        gguf_set_val_u32(g, key, (uint32_t) val);
    }
    // new metadata (tensor offsets are relative to the data section), then the original data section
    const std::string tmp = std::string(path) + suffix;
    bool written = gguf_write_to_file(g, tmp.c_str(), /*only_meta*/ true);
    gguf_free(g);
    if (written) {
        std::ifstream src(path, std::ios::binary);
        std::ofstream dst(tmp, std::ios::binary | std::ios::app);
        src.seekg((std::streamoff) data_offset);
        dst << src.rdbuf();
        written = dst.good();
    }
    return written ? tmp : "";
}

// malformed metadata must fail the load (nullptr), never abort
static void check_bad_metadata(const char * path, const char * key, int64_t val /* < 0: remove */, bool expect_load = false) {
    const std::string tmp = rewrite_model(path, key, val, ".bad.gguf");
    llama_model * m = !tmp.empty() ? llama_model_load_from_file(tmp.c_str(), llama_model_default_params()) : nullptr;
    const std::string name = std::string("bad metadata: ") + key + (val < 0 ? " missing" : " = " + std::to_string(val));
    check(name.c_str(), !tmp.empty() && (expect_load ? m != nullptr : m == nullptr));
    if (m) {
        llama_model_free(m);
    }
    if (!tmp.empty()) {
        std::remove(tmp.c_str());
    }
}

// a vectors case's generation parameters (block size, steps, temperature, new tokens)
static clover_gen_params case_params(const json & c) {
    clover_gen_params gp = clover_gen_default_params();
    gp.block_size     = c["block_size"].get<int>();
    gp.steps          = c["steps"].get<int>();
    gp.temperature    = c["temperature"].get<float>();
    gp.max_new_tokens = c["max_new_tokens"].get<int>();
    return gp;
}

static llama_context * make_ctx(llama_model * model, int n_ubatch) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx     = 4096;
    cp.n_batch   = n_ubatch;
    cp.n_ubatch  = n_ubatch;
    cp.n_seq_max = 1;
    cp.n_outputs_max_per_seq = 0; // every row of a denoising step goes through the pick sampler
    cp.n_threads = cp.n_threads_batch = 2;
    return llama_init_from_model(model, cp);
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf VECTORS.json [tolerance]\n", argv[0]);
        return 2;
    }
    const double tol = argc > 3 ? atof(argv[3]) : 1e-4;

    std::ifstream f(argv[2]);
    const json vec = json::parse(f);
    const json & cases = vec["cases"];

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "failed to load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_layer = llama_model_n_layer(model);

    llama_context * ctx = make_ctx(model, 8);   // one block per graph
    llama_context * ctp = make_ctx(model, 64);  // parallel prefill (up to 8 blocks per graph)
    if (!ctx || !ctp) {
        fprintf(stderr, "failed to create contexts\n");
        return 1;
    }

    // 1. one clean block, empty memory
    {
        const json & c = cases["block_empty_memory"];
        auto t = toks(c["tokens"]);
        std::vector<float> lg(t.size() * n_vocab);
        clover_reset(ctx);
        check("block_empty_memory: ok", clover_block_logits(ctx, t.data(), t.size(), lg.data()) == 0);
        report("block_empty_memory: logits", max_err_2d(lg, c["logits"], n_vocab), tol);
        check("block_empty_memory: memory still empty", clover_n_committed(ctx) == 0);
    }

    // 2. denoise after a 19-token prefill (blocks 8, 8, 3)
    {
        const json & c = cases["denoise_after_prefill"];
        auto p = toks(c["prompt"]);
        auto b = toks(c["block"]);
        const int B = c["block_size"].get<int>();
        clover_reset(ctx);
        check("denoise_after_prefill: commit", clover_commit(ctx, p.data(), p.size(), B) == 0);
        check("denoise_after_prefill: n_committed", clover_n_committed(ctx) == (int) p.size());
        double es = 0.0;
        std::vector<std::vector<float>> s0(n_layer);
        for (int il = 0; il < n_layer; ++il) {
            std::vector<float> ref;
            flatten(c["state_after_prefill"][il], ref);
            s0[il] = get_state(ctx, il);
            for (size_t i = 0; i < ref.size(); ++i) {
                es = std::max(es, (double) std::fabs(s0[il][i] - ref[i]));
            }
        }
        report("denoise_after_prefill: state", es, tol);

        std::vector<float> lg(b.size() * n_vocab), lg2(b.size() * n_vocab);
        check("denoise_after_prefill: denoise", clover_block_logits(ctx, b.data(), b.size(), lg.data()) == 0);
        report("denoise_after_prefill: logits", max_err_2d(lg, c["logits"], n_vocab), tol);

        bool same = true;
        for (int il = 0; il < n_layer; ++il) {
            auto s1 = get_state(ctx, il);
            same = same && memcmp(s1.data(), s0[il].data(), s1.size()*sizeof(float)) == 0;
        }
        check("denoise: state bit-for-bit unchanged", same);
        check("denoise: n_committed unchanged", clover_n_committed(ctx) == (int) p.size());
        clover_block_logits(ctx, b.data(), b.size(), lg2.data());
        check("denoise: repeated step identical", memcmp(lg.data(), lg2.data(), lg.size()*sizeof(float)) == 0);

        // parallel prefill == block-by-block
        clover_reset(ctp);
        check("parallel prefill: commit", clover_commit(ctp, p.data(), p.size(), B) == 0);
        double ep = 0.0;
        for (int il = 0; il < n_layer; ++il) {
            auto sp = get_state(ctp, il);
            for (size_t i = 0; i < sp.size(); ++i) {
                ep = std::max(ep, (double) std::fabs(sp[i] - s0[il][i]));
            }
        }
        report("parallel prefill: state vs blockwise", ep, 1e-5);
        std::vector<float> lgp(b.size() * n_vocab);
        clover_block_logits(ctp, b.data(), b.size(), lgp.data());
        report("parallel prefill: logits vs reference", max_err_2d(lgp, c["logits"], n_vocab), tol);
    }

    // 3. short block (L = 3) after one committed block
    {
        const json & c = cases["short_block"];
        auto p = toks(c["prompt"]);
        auto b = toks(c["block"]);
        std::vector<float> lg(b.size() * n_vocab);
        clover_reset(ctx);
        check("short_block: commit", clover_commit(ctx, p.data(), p.size(), 8) == 0);
        check("short_block: denoise", clover_block_logits(ctx, b.data(), b.size(), lg.data()) == 0);
        report("short_block: logits", max_err_2d(lg, c["logits"], n_vocab), tol);
    }

    // 4. greedy generation, steps schedule
    for (llama_context * cx : { ctx, ctp }) {
        const json & c = cases["greedy_steps"];
        auto p   = toks(c["prompt"]);
        auto ref = toks(c["tokens"]);
        const clover_gen_params gp = case_params(c);
        std::vector<llama_token> out(gp.max_new_tokens);
        const int n = clover_generate(cx, p.data(), p.size(), gp, out.data(), out.size(), nullptr, nullptr);
        out.resize(std::max(n, 0));
        bool eq = out == ref;
        if (!eq) {
            printf("  got:");
            for (auto t : out) printf(" %d", t);
            printf("\n  ref:");
            for (auto t : ref) printf(" %d", t);
            printf("\n");
        }
        check(cx == ctx ? "greedy_steps: tokens (n_ubatch=8)" : "greedy_steps: tokens (n_ubatch=64)", eq);
    }

    // 4b. a bias sampler (clover_batch_set_bias) on the greedy steps case: none gives the reference;
    //     -100 on its first token keeps that token out; +100 on one token fills every position with
    //     it; the penalties sampler has accepted each generated token once. Such a sequence is on
    //     the host: a lent pick sampler is refused.
    {
        const json & c = cases["greedy_steps"];
        auto p   = toks(c["prompt"]);
        auto ref = toks(c["tokens"]);
        clover_gen_params gp = case_params(c);
        gp.temperature = 0.0f;
        const llama_vocab * vocab = llama_model_get_vocab(model);
        llama_sampler * pick = clover_sampler_init_pick(model, 0.0f);
        // the generated blocks' tokens with smpl as sequence 0's bias sampler (empty on an error)
        auto run = [&](llama_sampler * smpl, bool & on_host, bool & pick_refused) {
            std::vector<llama_token> got;
            clover_batch * b = clover_batch_init(ctx);
            bool ok = b && clover_batch_add(b, 0, p.data(), (int32_t) p.size(), gp, false) == 0 &&
                      clover_batch_set_bias(b, 0, smpl) == 0;
            on_host = ok && clover_batch_on_host(b, 0) == 1;
            pick_refused = ok && smpl && clover_batch_set_pick(b, 0, pick) == CLOVER_ERR_ARG; // (pick is not attached)
            auto cb = [](llama_seq_id, const clover_block_stats * st, void * ud) {
                auto * v = (std::vector<llama_token> *) ud;
                v->insert(v->end(), st->tokens, st->tokens + st->n_tokens);
                return true;
            };
            int32_t r = 1;
            while (ok && (r = clover_batch_step(b, cb, &got)) > 0) {
            }
            clover_batch_free(b);
            if (!ok || r < 0) {
                got.clear();
            }
            return got;
        };
        auto chain = [&](llama_token tok, float bias, float freq) {
            llama_sampler * ch = llama_sampler_chain_init(llama_sampler_chain_default_params());
            if (bias != 0.0f) {
                const llama_logit_bias lb = { tok, bias };
                llama_sampler_chain_add(ch, llama_sampler_init_logit_bias(n_vocab, 1, &lb));
            }
            if (freq != 0.0f) {
                llama_sampler_chain_add(ch, llama_sampler_init_penalties(n_vocab, gp.max_new_tokens, 1.0f, freq, 0.0f));
            }
            return ch;
        };
        bool host = false, refused = false;
        auto none = run(nullptr, host, refused);
        check("bias: none gives the greedy reference", none == ref && !host);

        llama_sampler * ban = chain(ref[0], -100.0f, 0.0f);
        auto got = run(ban, host, refused);
        check("bias: on the host, no lent pick sampler", host && refused);
        check("bias: -100 keeps the greedy token out", !got.empty() &&
              std::find(got.begin(), got.end(), ref[0]) == got.end());
        llama_sampler_free(ban);

        llama_token t = 2;
        while (t == llama_vocab_mask(vocab) || t == llama_vocab_eos(vocab)) {
            t++;
        }
        llama_sampler * fill = chain(t, 100.0f, 0.0f);
        got = run(fill, host, refused);
        check("bias: +100 fills every position", (int) got.size() == gp.max_new_tokens &&
              std::count(got.begin(), got.end(), t) == (long) got.size());
        llama_sampler_free(fill);

        // frequency penalty 1: the sampler lowers each token's logit by its count
        llama_sampler * pen = chain(0, 0.0f, 1.0f);
        got = run(pen, host, refused);
        std::vector<llama_token_data> td(n_vocab);
        for (int v = 0; v < n_vocab; ++v) {
            td[v] = { v, 0.0f, 0.0f };
        }
        llama_token_data_array arr = { td.data(), td.size(), -1, false };
        llama_sampler_apply(pen, &arr);
        bool counted = !got.empty();
        for (int v = 0; v < n_vocab && counted; ++v) {
            counted = -td[v].logit == (float) std::count(got.begin(), got.end(), v);
        }
        check("bias: every generated token accepted once", counted);
        llama_sampler_free(pen);
        llama_sampler_free(pick);
    }

    llama_free(ctx);
    llama_free(ctp);
    llama_model_free(model);

    // 5. EOS: with eos_token_id = a token of the greedy reference (first occurring in its second
    //    block), generation stops after that block and drops the tokens from the first EOS on
    {
        const json & c = cases["greedy_steps"];
        auto p   = toks(c["prompt"]);
        auto ref = toks(c["tokens"]);
        const int B = c["block_size"].get<int>();
        // the first token from the second block on that does not occur before it
        int first = B;
        while (first + 1 < (int) ref.size() && std::find(ref.begin(), ref.begin() + first, ref[first]) != ref.begin() + first) {
            first++;
        }
        const llama_token eos = ref[first];
        const std::string path = rewrite_model(argv[1], "tokenizer.ggml.eos_token_id", eos, ".eos.gguf");
        llama_model * m = path.empty() ? nullptr : llama_model_load_from_file(path.c_str(), llama_model_default_params());
        llama_context * cx = m ? make_ctx(m, 8) : nullptr;
        bool ok = cx != nullptr;
        if (ok) {
            clover_gen_params gp = case_params(c); // block size B
            gp.temperature = 0.0f;
            std::vector<llama_token> out(gp.max_new_tokens);
            int n_blocks = 0;
            auto cb = [](const clover_block_stats *, void * ud) { (*(int *) ud)++; return true; };
            const int n = clover_generate(cx, p.data(), p.size(), gp, out.data(), out.size(), cb, &n_blocks);
            out.resize(std::max(n, 0));
            ok = n == first && std::equal(out.begin(), out.end(), ref.begin()) && n_blocks == first / B + 1;
            printf("  eos %d first at %d: got %d tokens in %d blocks\n", eos, first, n, n_blocks);
        }
        check("eos: stop after the block, drop from EOS on", ok);
        if (cx) {
            llama_free(cx);
        }
        if (m) {
            llama_model_free(m);
        }
        if (!path.empty()) {
            std::remove(path.c_str());
        }
    }

    // 7. libllama's generic block-diffusion calls, as a driver other than libclover would use them
    {
        llama_model * m = llama_model_load_from_file(argv[1], llama_model_default_params());
        llama_context * cx = m ? make_ctx(m, 64) : nullptr;
        check("hooks: model and context", cx != nullptr);
        if (cx) {
            std::vector<llama_token> t(32, 1);
            llama_batch b = llama_batch_get_one(t.data(), (int32_t) t.size());
            check("llama_decode: refused without llama_set_block_diffusion", llama_decode(cx, b) != 0);
            llama_set_block_diffusion(cx, true, false, 1); // 32 one-token blocks: more than a graph holds
            check("llama_decode: too many blocks per ubatch refused", llama_decode(cx, b) != 0);
            llama_set_block_diffusion(cx, false, false, 0);
            check("llama_decode: refusals leave the memory empty", clover_n_committed(cx) == 0);
            check("commit after the refusals", clover_commit(cx, t.data(), (int32_t) t.size(), 8) == 0);
            int64_t t_build = 0, t_compute = 0;
            int32_t n_build = 0;
            llama_perf_context_graph(cx, &t_build, &t_compute, &n_build);
            check("llama_perf_context_graph: graphs built and computed", n_build > 0 && t_build > 0 && t_compute > 0);
            // the default model params offload every layer, the output included, where there is a GPU
            const bool gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) != nullptr;
            check("llama_model_output_on_host: in host memory unless offloaded", llama_model_output_on_host(m) == !gpu);
            llama_free(cx);
        }
        if (m) {
            llama_model_free(m);
        }
    }

    // 6. malformed metadata fails the load with an error (no crash)
    check_bad_metadata(argv[1], "clover.diffusion.block_size", 16, /*expect_load*/ true); // control: a valid change loads
    check_bad_metadata(argv[1], "clover.diffusion.block_size", 0);
    check_bad_metadata(argv[1], "clover.diffusion.block_size", -1);
    check_bad_metadata(argv[1], "clover.ssm.conv_kernel", 0);
    check_bad_metadata(argv[1], "clover.attention.head_count_kv", 3);
    check_bad_metadata(argv[1], "clover.attention.key_length", 8);
    // caught by the validation before the generic hparams' asserts
    check_bad_metadata(argv[1], "clover.expert_used_count", 99);
    check_bad_metadata(argv[1], "clover.block_count", 0);
    llama_backend_free();

    printf("%s\n", g_fail == 0 ? "ALL OK" : "FAILURES");
    return g_fail == 0 ? 0 : 1;
}
