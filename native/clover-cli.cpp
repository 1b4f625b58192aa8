// llama-clover-cli: block-diffusion generation with a Clover GGUF (libclover, clover.h). Options,
// placement (-ngl, -ot, --cpu-moe, --rpc, --fit) and sampling are common's (LLAMA_EXAMPLE_DIFFUSION);
// --prompt-ids is this program's own. llama.cpp's llama-diffusion-cli runs the same model (block
// commit); this one adds what clover-gguf tests and serves with: constraints, ids, error lines.

#include "arg.h"
#include "clover.h"
#include "common.h"
#include "fit.h"
#include "gguf.h"
#include "llama.h"
#include "log.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <clocale>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <filesystem>
#include <system_error>

#include <fcntl.h>
#ifdef _WIN32
#    include <io.h>
#    define dup _dup
#    define dup2 _dup2
#    define close _close
#    define fileno _fileno
#    define DEV_NULL "NUL"
#else
#    include <unistd.h>
#    define DEV_NULL "/dev/null"
#endif

#define CLOVER_CLI_MAX_BLOCK  1024     // clover.diffusion.block_size's limit (src/clover-validate.cpp)
#define CLOVER_CLI_MAX_TOKENS (1 << 24)

static void print_usage(int /*argc*/, char ** argv) {
    LOG("\nexample usage:\n\n  %s -m clover.gguf -p 'def parse(path):' -n 64 [--diffusion-threshold 0.9] [--diffusion-visual]\n"
        "\nclover: --diffusion-block-length 0 is the model's block length; --diffusion-steps N with\n"
        "--diffusion-threshold 0 denoises each block in min(N, block length) steps; --prompt-ids ID,ID,... gives the\n"
        "prompt as token ids instead of -p\n\n", argv[0]);
}

// what common's parser takes without a range: one line naming the option and the allowed range
static bool in_range(const char * opt, double v, double lo, double hi, bool integer, bool lo_open = false) {
    if (std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi) {
        return true;
    }
    fprintf(stderr, "error: %s %.10g: must be %s in %s%.10g, %.10g]\n", opt, v, integer ? "an integer" : "a finite number",
            lo_open ? "(" : "[", lo, hi);
    return false;
}

static bool check_options(const common_params & p, const std::string & prompt_ids) {
    const auto & s = p.sampling;
    const auto & d = p.diffusion;
    if (!in_range("-n", p.n_predict, 1, CLOVER_CLI_MAX_TOKENS, true) ||
        !in_range("--diffusion-block-length", d.block_length, 0, CLOVER_CLI_MAX_BLOCK, true) ||
        !in_range("--diffusion-steps", d.steps, 1, CLOVER_CLI_MAX_TOKENS, true) ||
        !in_range("--diffusion-threshold", d.threshold, 0.0, 1.0, false) ||
        !in_range("--temp", s.temp, 0.0, 100.0, false) || !in_range("--top-k", s.top_k, 0, CLOVER_CLI_MAX_TOKENS, true) ||
        !in_range("--top-p", s.top_p, 0.0, 1.0, false, true) ||
        !in_range("-ub", p.n_ubatch, 0, 16 * CLOVER_CLI_MAX_BLOCK, true)) {
        return false;
    }
    if (!s.grammar.grammar.empty() && d.visual_mode) {
        fprintf(stderr, "error: --diffusion-visual: not with a grammar or JSON schema\n");
        return false;
    }
    if (p.prompt.empty() == prompt_ids.empty()) {
        fprintf(stderr, "error: give a prompt: -p PROMPT (or -f FILE) or --prompt-ids, one of them\n");
        return false;
    }
    return true;
}

// token ids of --prompt-ids, each in [0, n_vocab)
static bool parse_ids(const std::string & s, int32_t n_vocab, std::vector<llama_token> & out) {
    size_t pos = 0;
    while (pos < s.size()) {
        const size_t end = s.find_first_of(", ", pos);
        const std::string tok = s.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
        pos = end == std::string::npos ? s.size() : end + 1;
        if (tok.empty()) {
            continue;
        }
        errno = 0;
        char * e = nullptr;
        const long long v = strtoll(tok.c_str(), &e, 10);
        if (*e != '\0' || errno == ERANGE || v < 0 || v >= n_vocab) {
            fprintf(stderr, "error: --prompt-ids %s: token %s is not an id in [0, %d]\n", s.c_str(), tok.c_str(), n_vocab - 1);
            return false;
        }
        out.push_back((llama_token) v);
    }
    if (out.empty()) {
        fprintf(stderr, "error: --prompt-ids '%s': no token ids\n", s.c_str());
        return false;
    }
    return true;
}

struct cb_state {
    const llama_vocab * vocab;
    llama_token mask;
    bool show;
    bool printed_block = false;
};

static std::string piece(const llama_vocab * vocab, llama_token t) {
    char buf[256];
    const int n = llama_token_to_piece(vocab, t, buf, sizeof(buf), 0, true);
    return n > 0 ? std::string(buf, n) : std::string();
}

static std::string render(const cb_state * st, const llama_token * blk, int32_t n) {
    std::string s;
    for (int32_t i = 0; i < n; ++i) {
        if (blk[i] == st->mask) {
            s += "\xe2\x96\x91"; // light shade for a masked position
        } else {
            std::string p = piece(st->vocab, blk[i]);
            for (char & c : p) {
                if (c == '\n' || c == '\r' || c == '\t') c = ' ';
            }
            s += p;
        }
    }
    return s;
}

static bool on_step(int32_t block_index, int32_t step, const llama_token * blk, int32_t n, void * ud) {
    auto * st = (cb_state *) ud;
    if (st->show) {
        fprintf(stderr, "\r\x1b[2K[block %d step %d] %s", block_index, step, render(st, blk, n).c_str());
        fflush(stderr);
    }
    return true;
}

static bool on_block(const clover_block_stats * bs, void * ud) {
    auto * st = (cb_state *) ud;
    if (st->show) {
        fprintf(stderr, "\r\x1b[2K");
    }
    for (int32_t i = 0; i < bs->n_tokens; ++i) {
        if (bs->tokens[i] == llama_vocab_eos(st->vocab)) {
            break;
        }
        const std::string p = piece(st->vocab, bs->tokens[i]);
        fwrite(p.data(), 1, p.size(), stdout);
    }
    fflush(stdout);
    return true;
}

// the reason a load failed, for the one-line message: the text of llama.cpp's "error loading
// model: ..." line, or, when that only says the GGUF could not be parsed, the parser's own error
static std::string              g_last_error;
static std::vector<std::string> g_errors;
// where the load put layers and buffers (printed with --rpc): llama.cpp logs it, at info level
static std::vector<std::string> g_placement;

static void quiet_log(enum ggml_log_level level, const char * text, void * /*ud*/) {
    if (level == GGML_LOG_LEVEL_INFO && (strstr(text, "offloaded ") || strstr(text, "model buffer size") ||
                                         strstr(text, "RS buffer size"))) {
        g_placement.push_back(text);
    }
    if (level != GGML_LOG_LEVEL_ERROR) {
        return;
    }
    std::string t = text;
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
    if (t.empty()) {
        return;
    }
    const std::string mark = "error loading model: ";
    const size_t p = t.find(mark);
    if (p == std::string::npos) {
        const size_t c = t.find(": ");
        g_errors.push_back(c == std::string::npos ? t : t.substr(c + 2));
        if (g_last_error.empty()) g_last_error = g_errors.back();
        return;
    }
    g_last_error = t.substr(p + mark.size());
    // the clover validation runs inside load_hparams, whose errors llama_model_load prefixes
    const std::string hp = "error loading model hyperparameters: ";
    if (g_last_error.rfind(hp, 0) == 0) {
        g_last_error = g_last_error.substr(hp.size());
    }
    if (g_last_error.rfind("llama_model_loader: failed to load model from", 0) == 0 && !g_errors.empty()) {
        g_last_error = g_errors.front();
    }
}

static void verbose_log(enum ggml_log_level level, const char * text, void * ud) {
    quiet_log(level, text, ud);
    fputs(text, stderr);
}


// the block length the GGUF declares (0 if it cannot say): the fit sizes n_ubatch from it before
// the load, which validates the file
static int32_t gguf_block_size(const std::string & path) {
    gguf_init_params gp = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path.c_str(), gp);
    if (!g) {
        return 0;
    }
    const int64_t id = gguf_find_key(g, "clover.diffusion.block_size");
    const int32_t B = id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_UINT32 ? (int32_t) gguf_get_val_u32(g, id) : 0;
    gguf_free(g);
    return B > 0 && B <= CLOVER_CLI_MAX_BLOCK ? B : 0;
}

static bool has_device(enum ggml_backend_dev_type type, const char * reg_name = nullptr) {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (reg_name ? strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), reg_name) == 0
                     : ggml_backend_dev_type(dev) == type) {
            return true;
        }
    }
    return false;
}

// ggml reports bad tensor data with fprintf(stderr): keep it off the one-line error
static llama_model * load_quietly(const std::string & path, const llama_model_params & mp, bool verbose) {
    int saved = -1;
    if (!verbose) {
        fflush(stderr);
        saved = dup(2);
        const int devnull = open(DEV_NULL, O_WRONLY);
        if (devnull >= 0) {
            dup2(devnull, 2);
            close(devnull);
        }
    }
    llama_model * model = llama_model_load_from_file(path.c_str(), mp);
    if (saved >= 0) {
        fflush(stderr);
        dup2(saved, 2);
        close(saved);
    }
    return model;
}

static void print_perf(llama_context * ctx, int32_t B) {
    clover_perf pf;
    clover_get_perf(ctx, &pf);
    fprintf(stderr, "\nprompt:     %d tokens in %.1f ms: %.2f tok/s\n", pf.n_prompt, pf.t_prompt_ms,
            pf.t_prompt_ms > 0 ? 1e3 * pf.n_prompt / pf.t_prompt_ms : 0.0);
    fprintf(stderr, "generation: %d tokens in %.1f ms: %.2f tok/s (%d blocks of <= %d, commits %.1f ms)\n",
            pf.n_gen, pf.t_gen_ms, pf.t_gen_ms > 0 ? 1e3 * pf.n_gen / pf.t_gen_ms : 0.0, pf.n_blocks, B, pf.t_commit_ms);
    fprintf(stderr, "steps:      %d in total, %.2f ms per step, %.2f steps per block, %.2f tokens per step\n",
            pf.n_steps, pf.n_steps ? (pf.t_gen_ms - pf.t_commit_ms) / pf.n_steps : 0.0,
            pf.n_blocks ? (double) pf.n_steps / pf.n_blocks : 0.0,
            pf.n_steps ? (double) pf.n_gen / pf.n_steps : 0.0);
    const double ns = std::max(1, pf.n_steps);
    fprintf(stderr, "per step:   graph build %.3f ms (%d of %d steps built a graph), compute %.2f ms, "
            "host %.3f ms, other %.3f ms; candidates on the device in %d of %d steps\n",
            pf.t_step_graph_ms / ns, pf.n_step_graphs, pf.n_steps, pf.t_step_compute_ms / ns,
            pf.t_step_host_ms / ns, pf.t_step_other_ms / ns, pf.n_steps_device, pf.n_steps);
}

// generation on one sequence of a clover_batch constrained by llama.cpp's grammar sampler
static int32_t generate_constrained(llama_context * ctx, const llama_vocab * vocab, const std::string & grammar,
                                    const std::vector<llama_token> & prompt, const clover_gen_params & gp,
                                    std::vector<llama_token> & out, cb_state * st) {
    // llama.cpp's grammar parser prints its reason to stderr: keep it for the one-line error
    fflush(stderr);
    FILE * tmp = tmpfile();
    const int saved = dup(2);
    if (tmp) {
        dup2(fileno(tmp), 2);
    }
    llama_sampler * smpl = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    std::string why = g_last_error;
    if (tmp) {
        char line[512];
        rewind(tmp);
        while (fgets(line, sizeof(line), tmp)) {
            const char * m = strstr(line, "error parsing grammar: ");
            if (m) {
                why = std::string(m + strlen("error parsing grammar: "));
                why.erase(why.find_last_not_of("\r\n") + 1);
                break;
            }
        }
        fclose(tmp);
    }
    if (!smpl) {
        fprintf(stderr, "error: --grammar: %s\n", why.empty() ? "does not parse" : why.c_str());
        exit(1);
    }
    clover_perf_reset(ctx);
    clover_batch * b = clover_batch_init(ctx);
    int32_t ret = b ? clover_batch_add(b, 0, prompt.data(), (int32_t) prompt.size(), gp, false) : CLOVER_ERR_ARG;
    if (ret == 0) {
        ret = clover_batch_set_constraint(b, 0, smpl);
    }
    auto cb = [](llama_seq_id, const clover_block_stats * bs, void * ud) { return on_block(bs, ud); };
    while (ret == 0 && (ret = clover_batch_step(b, cb, st)) > 0) {
        ret = 0;
    }
    if (ret == 0) {
        ret = std::min(clover_batch_tokens(b, 0, out.data(), (int32_t) out.size()), (int32_t) out.size());
    }
    clover_batch_free(b);
    llama_sampler_free(smpl);
    return ret;
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    common_params params;
    // Clover's defaults where common's differ: 64 new tokens, greedy, seed 0, n_ubatch of four blocks
    params.n_predict      = 64;
    params.n_ubatch       = 0;
    params.sampling.temp  = 0.0f;
    params.sampling.top_k = 0;
    params.sampling.top_p = 1.0f;
    params.sampling.seed  = 0;
    params.diffusion.threshold = 0.9f;
    common_init();
    // --prompt-ids ID,ID,... is this program's: taken out before common's parser sees the arguments
    std::string prompt_ids;
    std::vector<char *> args;
    for (int i = 0; i < argc; ++i) {
        if (strcmp(argv[i], "--prompt-ids") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: --prompt-ids: expected a value (ID,ID,...)\n");
                return 1;
            }
            prompt_ids = argv[++i];
            continue;
        }
        args.push_back(argv[i]);
    }
    if (!common_params_parse((int) args.size(), args.data(), params, LLAMA_EXAMPLE_DIFFUSION, print_usage) ||
        !check_options(params, prompt_ids)) {
        return 1;
    }
    const bool verbose = params.verbosity >= LOG_LEVEL_DEBUG;
    llama_log_set(verbose ? verbose_log : quiet_log, nullptr);
    const std::string & path = params.model.path;
    // only a regular file: opening a FIFO or a device for reading could block forever
    std::error_code ec;
    const auto st_path = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::is_regular_file(st_path)) {
        fprintf(stderr, "error: %s: %s\n", path.c_str(), ec ? ec.message().c_str() : "not a regular file");
        return 1;
    }
    llama_backend_init();

    const auto & dp = params.diffusion;
    const int32_t B_file = dp.block_length > 0 ? dp.block_length : gguf_block_size(path);
    llama_model_params   mp = common_model_params_to_llama(params);
    llama_context_params cp = common_context_params_to_llama(params);
    mp.check_tensors = true; // NaN/Inf weights fail the load instead of generating garbage
    cp.n_seq_max = 1;
    cp.n_outputs_max_per_seq = 0; // every row of a denoising step goes through the pick sampler
    cp.n_ubatch  = params.n_ubatch > 0 ? params.n_ubatch : 4 * std::max(B_file, 1);
    cp.n_ctx     = std::max<uint32_t>(cp.n_ubatch, params.n_ctx); // the memory is recurrent: n_ctx costs nothing
    if (params.fit_params && (has_device(GGML_BACKEND_DEVICE_TYPE_GPU) || has_device(GGML_BACKEND_DEVICE_TYPE_IGPU))) {
        common_fit_params(path.c_str(), &mp, &cp, params.tensor_split, params.tensor_buft_overrides.data(),
                          params.fit_params_target.data(), params.fit_params_min_ctx, nullptr,
                          verbose ? GGML_LOG_LEVEL_DEBUG : GGML_LOG_LEVEL_ERROR);
    }
    g_last_error.clear(); // what the metadata read and the fit logged: the load says it again
    g_errors.clear();
    g_placement.clear();
    llama_model * model = load_quietly(path, mp, verbose);
    if (!model) {
        fprintf(stderr, "error: %s: %s\n", path.c_str(), g_last_error.empty() ? "failed to load" : g_last_error.c_str());
        return 1;
    }
    const int32_t B_model = clover_model_block_size(model);
    if (B_model < 0) {
        fprintf(stderr, "error: %s is not a clover model\n", path.c_str());
        return 1;
    }
    const int32_t B = dp.block_length > 0 ? dp.block_length : B_model;
    const llama_vocab * vocab = llama_model_get_vocab(model);

    std::vector<llama_token> prompt;
    if (!prompt_ids.empty()) {
        if (!parse_ids(prompt_ids, llama_vocab_n_tokens(vocab), prompt)) {
            return 1;
        }
    } else if ((prompt = common_tokenize(vocab, params.prompt, true, true)).empty()) {
        fprintf(stderr, "error: -p: the prompt gives no tokens\n");
        return 1;
    }
    // positions used: the prompt, then whole blocks of generation
    const int64_t n_pos = (int64_t) prompt.size() + ((int64_t) params.n_predict + B - 1) / B * B;
    const int64_t n_ctx_train = llama_model_n_ctx_train(model);
    if (n_pos > n_ctx_train) {
        fprintf(stderr, "error: -n %d: the prompt (%zu tokens) and %d new tokens in blocks of %d need %" PRId64 " positions, "
                "more than the model's context length (%" PRId64 ")\n", params.n_predict, prompt.size(), params.n_predict,
                B, n_pos, n_ctx_train);
        return 1;
    }
    cp.n_ubatch = std::max<uint32_t>(cp.n_ubatch, B);
    cp.n_batch  = cp.n_ubatch;
    cp.n_ctx    = (uint32_t) std::max<int64_t>(cp.n_ubatch, n_pos);
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "error: %s: failed to create the context: %s\n", path.c_str(),
                g_last_error.empty() ? "see -v" : g_last_error.c_str());
        return 1;
    }
    if (has_device(GGML_BACKEND_DEVICE_TYPE_GPU, "RPC") && !verbose) { // the split (with -v it is in the log)
        for (const auto & line : g_placement) {
            fputs(line.c_str(), stderr);
        }
    }

    clover_gen_params gp = clover_gen_default_params();
    gp.block_size     = B;
    gp.steps          = dp.threshold > 0 ? 0 : std::min(dp.steps, B);
    gp.threshold      = dp.threshold;
    gp.temperature    = params.sampling.temp;
    gp.top_k          = params.sampling.top_k;
    gp.top_p          = params.sampling.top_p;
    gp.seed           = params.sampling.seed == LLAMA_DEFAULT_SEED ? std::random_device{}() : params.sampling.seed;
    gp.max_new_tokens = params.n_predict;
    fputs(params.prompt.c_str(), stdout); // empty with --prompt-ids
    fflush(stdout);

    cb_state st { vocab, llama_vocab_mask(vocab), dp.visual_mode };
    const std::string & grammar = params.sampling.grammar.grammar;
    std::vector<llama_token> out(params.n_predict);
    const int32_t n = grammar.empty()
        ? clover_generate_ex(ctx, prompt.data(), prompt.size(), gp, out.data(), out.size(), on_block,
                             st.show ? on_step : nullptr, &st)
        : generate_constrained(ctx, vocab, grammar, prompt, gp, out, &st);
    printf("\n");
    if (n < 0) {
        fprintf(stderr, "error: generation failed (%d)%s%s\n", n, g_last_error.empty() ? "" : ": ", g_last_error.c_str());
        return 1;
    }
    if (params.verbose_prompt) { // the prompt's and the generated ids, on stdout after the text
        printf("prompt ids:");
        for (llama_token t : prompt) {
            printf(" %d", t);
        }
        printf("\nids:");
        for (int32_t i = 0; i < n; ++i) {
            printf(" %d", out[i]);
        }
        printf("\n");
    }
    if (!params.no_perf) {
        print_perf(ctx, B);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
