// Clover block-diffusion generation (C API in clover.h), a library beside the tools: it drives a
// clover context through llama.cpp's public API (llama_decode in block-diffusion mode, batches,
// the memory API and backend sampling), as the llama-diffusion library does for LLaDA and Dream.
//
// State handling: each sequence's Clover memory is its cell of the context's recurrent memory.
// Commit mode decodes blocks and folds them into the state; denoise mode (llama_set_block_diffusion)
// only reads the state, and the position advance of the memory cell is undone afterwards (seq_add
// -L, or seq_rm when the sequence had no history), so the next step or commit starts at the same
// position.
//
// Denoising steps compute each masked row's candidate and confidence on the device through a
// backend sampler (clover_sampler_init_pick, attached with llama_set_sampler) unless top-k / top-p
// sampling, a constraint, a bias sampler or top probabilities are asked for: then the rows' logits
// come to the host. Both paths draw the same noise (clover_step_key / clover_row_key), so a seed gives the
// same tokens either way and in the PyTorch reference.

#include "clover.h"
#include "noise.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// llama.cpp's log (llama_log_set's callback), so that callers see these lines with its own
void log_to_llama(ggml_log_level level, const char * fmt, ...) {
    ggml_log_callback cb = nullptr;
    void * ud = nullptr;
    llama_log_get(&cb, &ud);
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    if (cb) {
        cb(level, buf, ud);
    } else {
        fputs(buf, stderr);
    }
}

#define CLOVER_LOG_ERROR(...) log_to_llama(GGML_LOG_LEVEL_ERROR, __VA_ARGS__)
#define CLOVER_LOG_WARN(...)  log_to_llama(GGML_LOG_LEVEL_WARN, __VA_ARGS__)

// the graph bound of a parallel prefill in libllama (LLAMA_CLOVER_MAX_BLOCKS_PER_GRAPH)
constexpr int32_t MAX_BLOCKS_PER_GRAPH = 16;

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// the model's metadata value as an integer, or -1
int64_t meta_int(const llama_model * model, const char * key) {
    char buf[64];
    if (llama_model_meta_val_str(model, key, buf, sizeof(buf)) < 0) {
        return -1;
    }
    char * end = nullptr;
    const long long v = strtoll(buf, &end, 10);
    return end != buf && *end == '\0' ? (int64_t) v : -1;
}

bool is_clover_model(const llama_model * model) {
    char arch[32];
    return model && llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch)) >= 0 &&
           strcmp(arch, "clover") == 0;
}

bool is_clover(const llama_context * ctx) {
    return ctx && is_clover_model(llama_get_model(ctx));
}

// per context (a driver's figures; the context has no room for them)
std::mutex                                             perf_mutex;
std::unordered_map<const llama_context *, clover_perf> perf_map;

clover_perf & perf_of(const llama_context * ctx) {
    std::lock_guard<std::mutex> lock(perf_mutex);
    return perf_map[ctx]; // references to elements survive a rehash
}

// a clover context, or an error naming the caller
bool require_clover(const llama_context * ctx, const char * fn) {
    if (!is_clover(ctx)) {
        CLOVER_LOG_ERROR("%s: not a clover context\n", fn);
        return false;
    }
    return true;
}

// run f, turning any exception into an error code (nothing may cross the C boundary)
template <typename F>
int32_t guarded(const char * fn, F && f) {
    try {
        return f();
    } catch (const std::exception & e) {
        CLOVER_LOG_ERROR("%s: %s\n", fn, e.what());
    } catch (...) {
        CLOVER_LOG_ERROR("%s: unknown error\n", fn);
    }
    return CLOVER_ERR_EXCEPTION;
}


// The candidate choice as a backend sampler: ggml_gumbel_argmax of its sequence's output rows,
// each with the noise key of the row's position, so that only the candidate and its confidence
// leave the device. Backend sampling applies it to all of the sequence's rows at once
// (backend_apply_rows), or to one row at a time; the driver gives the keys of the next decode's
// rows in row order.
struct pick_sampler {
    float       temperature = 0.0f;
    llama_token mask_id     = -1;
    std::vector<ggml_tensor *> inp_keys; // I32 [2, rows] per application in the current graph
    std::vector<uint64_t>      keys;     // the rows' keys for the next decode
};

const char * pick_name(const llama_sampler * /*smpl*/) {
    return "clover-pick";
}

// on the host (a backend that cannot run the op): the greedy choice; the driver does not take
// this path, it reads the rows' logits instead (pick_host)
void pick_apply(llama_sampler * smpl, llama_token_data_array * cur_p) {
    const auto * p = (const pick_sampler *) smpl->ctx;
    int64_t best = -1;
    for (size_t i = 0; i < cur_p->size; ++i) {
        if (cur_p->data[i].id != p->mask_id && (best < 0 || cur_p->data[i].logit > cur_p->data[best].logit)) {
            best = (int64_t) i;
        }
    }
    cur_p->selected = best;
}

llama_sampler * pick_init(float temperature, llama_token mask_id);

llama_sampler * pick_clone(const llama_sampler * smpl) {
    const auto * p = (const pick_sampler *) smpl->ctx;
    return pick_init(p->temperature, p->mask_id);
}

void pick_free(llama_sampler * smpl) {
    delete (pick_sampler *) smpl->ctx;
}

bool pick_backend_init(llama_sampler * smpl, ggml_backend_buffer_type_t buft, uint32_t /*n_outputs_max_per_seq*/) {
    const auto * p = (const pick_sampler *) smpl->ctx;
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev) {
        return true;
    }
    ggml_init_params ip = { 8 * ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return false;
    }
    ggml_tensor * a    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 16, 1);
    ggml_tensor * keys = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 2, 1);
    ggml_tensor * pick = ggml_gumbel_argmax(ctx, a, keys, p->mask_id, p->temperature);
    ggml_tensor * tok  = ggml_cast(ctx, ggml_view_1d(ctx, pick, 1, 0), GGML_TYPE_I32);
    const bool ok = ggml_backend_dev_supports_op(dev, pick) && ggml_backend_dev_supports_op(dev, tok);
    ggml_free(ctx);
    return ok;
}

// logits [n_vocab, rows] -> sampled I32 [rows], probs F32 [1, rows]
void pick_apply_rows(pick_sampler * p, ggml_context * ctx, ggml_tensor * logits, llama_sampler_data * data) {
    const int64_t rows = logits->ne[1];
    ggml_tensor * keys = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 2, rows);
    ggml_format_name(keys, "clover_pick_keys_%zu", p->inp_keys.size());
    ggml_set_input(keys);
    p->inp_keys.push_back(keys);

    ggml_tensor * pick = ggml_gumbel_argmax(ctx, logits, keys, p->mask_id, p->temperature); // (c, p) per row
    ggml_set_name(pick, "clover_pick");
    ggml_tensor * tok = ggml_cast(ctx, ggml_view_2d(ctx, pick, 1, rows, pick->nb[1], 0), GGML_TYPE_I32);
    data->sampled = ggml_reshape_1d(ctx, tok, rows);
    data->probs   = ggml_cont(ctx, ggml_view_2d(ctx, pick, 1, rows, pick->nb[1], sizeof(float))); // the confidence only
    data->logits  = nullptr;                                                                      // no row leaves the device
}

void pick_backend_apply(llama_sampler * smpl, ggml_context * ctx, ggml_cgraph * /*gf*/, llama_sampler_data * data) {
    pick_apply_rows((pick_sampler *) smpl->ctx, ctx, ggml_reshape_2d(ctx, data->logits, ggml_nelements(data->logits), 1), data);
    data->sampled = ggml_reshape_1d(ctx, data->sampled, 1);
    data->probs   = ggml_reshape_1d(ctx, data->probs, 1);
}

void pick_backend_apply_rows(llama_sampler * smpl, ggml_context * ctx, ggml_cgraph * /*gf*/, llama_sampler_data * data) {
    pick_apply_rows((pick_sampler *) smpl->ctx, ctx, data->logits, data);
}

void pick_backend_set_input(llama_sampler * smpl) {
    const auto * p = (const pick_sampler *) smpl->ctx;
    size_t j = 0;
    std::vector<int32_t> w;
    for (ggml_tensor * t : p->inp_keys) {
        w.resize(2 * t->ne[1]);
        for (int64_t r = 0; r < t->ne[1]; ++r, ++j) {
            // rows past the given keys (the placeholder row of a sequence without outputs) get key 0
            const uint64_t k = j < p->keys.size() ? p->keys[j] : 0;
            w[2 * r + 0] = (int32_t) (uint32_t) k;
            w[2 * r + 1] = (int32_t) (uint32_t) (k >> 32);
        }
        ggml_backend_tensor_set(t, w.data(), 0, w.size() * sizeof(int32_t));
    }
}

void pick_backend_reset(llama_sampler * smpl) {
    ((pick_sampler *) smpl->ctx)->inp_keys.clear();
}

llama_sampler_i pick_iface = {
    /*.name              =*/ pick_name,
    /*.accept            =*/ nullptr,
    /*.apply             =*/ pick_apply,
    /*.reset             =*/ nullptr,
    /*.clone             =*/ pick_clone,
    /*.free              =*/ pick_free,
    /*.backend_init      =*/ pick_backend_init,
    /*.backend_accept    =*/ nullptr,
    /*.backend_apply     =*/ pick_backend_apply,
    /*.backend_set_input =*/ pick_backend_set_input,
    /*.backend_reset     =*/ pick_backend_reset,
    /*.copy_state        =*/ nullptr,
    /*.backend_apply_rows =*/ pick_backend_apply_rows,
};

llama_sampler * pick_init(float temperature, llama_token mask_id) {
    auto * p = new pick_sampler();
    p->temperature = temperature;
    p->mask_id     = mask_id;
    return llama_sampler_init(&pick_iface, p);
}

// the pick sampler inside a chain made by clover_sampler_init_pick, else nullptr
pick_sampler * pick_of(llama_sampler * chain) {
    if (!chain || llama_sampler_chain_n(chain) != 1) {
        return nullptr;
    }
    llama_sampler * s = llama_sampler_chain_get(chain, 0);
    return s && s->iface == &pick_iface ? (pick_sampler *) s->ctx : nullptr;
}

// the keys of a decode's rows of one sequence: rows[i] != 0 marks an output row at pos0 + i
void pick_set_keys(pick_sampler * p, uint64_t step_key, llama_pos pos0, const int8_t * rows, int32_t n) {
    p->keys.clear();
    for (int32_t i = 0; i < n; ++i) {
        if (rows[i]) {
            p->keys.push_back(clover_row_key(step_key, pos0 + i));
        }
    }
}

llama_pos next_pos(llama_context * ctx, llama_seq_id seq) {
    const llama_pos p = llama_memory_seq_pos_max(llama_get_memory(ctx), seq);
    return p < 0 ? 0 : p + 1;
}

int32_t resolve_block(const llama_context * ctx, int32_t block_size) {
    return block_size > 0 ? block_size : (int32_t) meta_int(llama_get_model(ctx), "clover.diffusion.block_size");
}

int32_t n_cap(llama_context * ctx) {
    return std::min((int32_t) llama_n_ubatch(ctx), (int32_t) llama_n_batch(ctx));
}

// one llama_decode in the given mode (sets the API flag that lets a clover context decode)
int32_t decode(llama_context * ctx, const llama_batch & batch, bool denoise, uint32_t block) {
    llama_set_block_diffusion(ctx, true, denoise, block);
    const int32_t ret = llama_decode(ctx, batch);
    llama_set_block_diffusion(ctx, false, false, 0);
    if (ret != 0) {
        CLOVER_LOG_ERROR("%s: llama_decode failed (%d)\n", __func__, ret);
        return ret < 0 ? ret : -ret - 100;
    }
    return 0;
}

// tokens of one sequence as a batch; outputs: nullptr -> no outputs, else outputs[i] != 0 requests row i
llama_batch seq_batch(const llama_token * toks, int32_t n, llama_seq_id seq, llama_pos pos0, const int8_t * outputs) {
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int32_t i = 0; i < n; ++i) {
        batch.token[i]     = toks[i];
        batch.pos[i]       = pos0 + i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i]    = outputs ? outputs[i] != 0 : 0;
    }
    batch.n_tokens = n;
    return batch;
}

// after a denoise decode: undo the position advance of the sequence's memory cell
void undo_advance(llama_context * ctx, llama_seq_id seq, llama_pos pos0, int32_t n) {
    llama_memory_t mem = llama_get_memory(ctx);
    if (llama_memory_seq_pos_max(mem, seq) >= pos0) {
        if (pos0 == 0) {
            llama_memory_seq_rm(mem, seq, -1, -1);
        } else {
            llama_memory_seq_add(mem, seq, pos0, -1, -n);
        }
    }
}

int32_t commit_seq(llama_context * ctx, llama_seq_id seq, const llama_token * tokens, int32_t n_tokens, int32_t B) {
    const int32_t cap = n_cap(ctx);
    if (B <= 0 || B > cap) {
        CLOVER_LOG_ERROR("%s: block size %d must be in [1, min(n_ubatch, n_batch) = %d]\n", __func__, B, cap);
        return CLOVER_ERR_BLOCK;
    }
    // full blocks per graph (parallel prefill: the graph runs the delta rule block by block)
    const int32_t k = std::max(1, std::min(cap / B, MAX_BLOCKS_PER_GRAPH));

    llama_pos pos = next_pos(ctx, seq);
    for (int32_t i = 0; i < n_tokens; ) {
        const int32_t n_full = (n_tokens - i) / B;
        const bool    multi  = n_full >= 2 && k >= 2;
        const int32_t n      = multi ? std::min(n_full, k) * B : std::min(B, n_tokens - i);
        llama_batch batch = seq_batch(tokens + i, n, seq, pos, nullptr);
        const int32_t ret = decode(ctx, batch, /*denoise*/ false, multi ? (uint32_t) B : 0);
        llama_batch_free(batch);
        if (ret != 0) {
            CLOVER_LOG_ERROR("%s: commit failed at position %d\n", __func__, pos);
            return ret;
        }
        i   += n;
        pos += n;
    }
    return 0;
}

// Candidate and confidence of one logits row on the host: at T > 0 the column maximising a/T +
// noise over the kept set (every column but the mask token and those at -inf, then top-k, then the
// smallest prefix by probability reaching top-p); at T = 0 the argmax (lowest column on ties). Its
// confidence is its probability under softmax(a/T) (T = 1 when greedy) over the candidate columns
// before top-k/top-p. A row whose logits are not finite gives ok = false; a row with no column
// left (a constraint allowing nothing) gives tok = -1.
struct candidate {
    llama_token tok  = -1;
    float       conf = 0.0f;
    bool        ok   = true;
};

using prob_list = std::vector<std::pair<float, llama_token>>;

bool by_prob(const std::pair<float, llama_token> & x, const std::pair<float, llama_token> & y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
}

// the model's logits hold no NaN or +-Inf, the mask's column included (as ggml_gumbel_argmax and
// the reference check); pick_host reads -Inf as "not allowed", so it cannot tell
bool row_finite(const float * a, int32_t n_vocab) {
    for (int32_t v = 0; v < n_vocab; ++v) {
        if (!std::isfinite(a[v])) {
            return false;
        }
    }
    return true;
}

candidate pick_host(const float * a, int32_t n_vocab, llama_token mask_id, const clover_gen_params & p,
                    uint64_t row_key, prob_list & work) {
    const bool  greedy = p.temperature <= 0.0f;
    const float T      = greedy ? 1.0f : p.temperature;
    candidate c;
    float maxv = -INFINITY;
    for (int32_t v = 0; v < n_vocab; ++v) {
        if (v != mask_id) {
            maxv = std::max(maxv, a[v]);
        }
    }
    if (maxv == -INFINITY) {
        return c; // nothing allowed
    }
    double sum = 0.0;
    work.clear();
    for (int32_t v = 0; v < n_vocab; ++v) {
        if (v != mask_id && a[v] != -INFINITY) {
            const double e = std::exp((double) (a[v] - maxv) / T);
            sum += e;
            work.emplace_back((float) e, v);
        }
    }
    if (greedy) {
        for (const auto & w : work) {
            if (a[w.second] == maxv) {
                c.tok = w.second; // work is in column order: the lowest column of the maximum
                break;
            }
        }
    } else {
        int32_t n_keep = (int32_t) work.size();
        if (p.top_k > 0 && p.top_k < n_keep) {
            n_keep = p.top_k;
            std::partial_sort(work.begin(), work.begin() + n_keep, work.end(), by_prob);
        } else {
            std::sort(work.begin(), work.end(), by_prob);
        }
        if (p.top_p > 0.0f && p.top_p < 1.0f) {
            double z = 0.0;
            for (int32_t k = 0; k < n_keep; ++k) {
                z += work[k].first;
            }
            double cum = 0.0;
            int32_t k = 0;
            while (k < n_keep && cum < p.top_p * z) {
                cum += work[k].first;
                ++k;
            }
            n_keep = std::max(1, k);
        }
        double best_s = -INFINITY;
        c.tok = work[0].second;
        for (int32_t k = 0; k < n_keep; ++k) {
            const llama_token v = work[k].second;
            const double s = (double) a[v] / T + clover_gumbel_noise(row_key, v);
            if (s > best_s || (s == best_s && v < c.tok)) {
                best_s = s;
                c.tok  = v;
            }
        }
    }
    c.conf = (float) (std::exp((double) (a[c.tok] - maxv) / T) / sum);
    c.ok   = std::isfinite(c.conf);
    return c;
}

// the n most probable columns of the row pick_host last saw (work holds exp((a - max)/T)), best first
void top_probs(prob_list & work, int32_t n, llama_token * tok_out, float * prob_out) {
    double sum = 0.0;
    for (const auto & w : work) {
        sum += w.first;
    }
    const int32_t k = std::min<int32_t>(n, (int32_t) work.size());
    std::partial_sort(work.begin(), work.begin() + k, work.end(), by_prob);
    for (int32_t j = 0; j < n; ++j) {
        tok_out[j]  = j < k ? work[j].second : -1;
        prob_out[j] = j < k ? (float) (work[j].first / sum) : 0.0f;
    }
}

} // namespace

// one sequence being generated
struct clover_seq {
    llama_seq_id      id = 0;
    clover_gen_params p  = {};
    int32_t  B       = 0;
    int32_t  n_max   = 0;     // tokens to generate
    uint64_t seed    = 0;
    bool     active  = false;
    bool     eos     = false; // a completed block held EOS
    bool     ended   = false; // a constrained sequence unmasked an end-of-generation token
    int32_t  n_gen   = 0;     // tokens of completed blocks
    std::vector<llama_token> out; // completed blocks' tokens up to the first EOS

    llama_sampler * constraint = nullptr; // clover_batch_set_constraint (not owned)
    std::vector<llama_token> triggers;    // clover_batch_set_triggers: the constraint is lazy
    bool    lazy  = false;                // no trigger token accepted yet
    int32_t n_acc = 0;                    // positions of the block accepted into the lazy constraint
    int32_t         n_top      = 0;       // clover_batch_set_top_probs
    llama_sampler * bias       = nullptr; // clover_batch_set_bias (not owned)
    std::vector<std::pair<int32_t, llama_token>> biased; // accepted into bias: (position in the reply, token)

    // the current block
    int32_t block_index = 0;
    int32_t step        = 0;
    int32_t L           = 0;
    int32_t M           = 0;  // masked positions at the block's start
    int32_t T           = 0;  // steps schedule of this block (0: threshold)
    std::vector<llama_token> blk;
    std::vector<float>       prob;    // [L] probability of each position's token when unmasked
    std::vector<llama_token> top_tok; // [L * n_top]
    std::vector<float>       top_p;   // [L * n_top]
    std::vector<int32_t>     per_step;
    std::vector<float>       ms_step;

    // the host computes this sequence's candidates (the rows' logits come to the host)
    bool on_host() const {
        const bool top_k = p.top_k > 0;
        const bool top_p = p.top_p > 0.0f && p.top_p < 1.0f;
        return constraint || bias || n_top > 0 || (p.temperature > 0.0f && (top_k || top_p));
    }
};

struct clover_batch {
    llama_context * ctx = nullptr;
    std::vector<clover_seq> seqs; // indexed by seq_id
    std::vector<llama_sampler *> pick; // indexed by seq_id: the pick sampler attached to it, if any
    std::vector<bool>            lent; // indexed by seq_id: pick[seq_id] is the caller's (clover_batch_set_pick)

    clover_batch() = default;
    clover_batch(const clover_batch &) = delete;
    clover_batch & operator=(const clover_batch &) = delete;
    ~clover_batch();

    // a sampler chain is initialised for one attachment: each attach makes a new one. A lent
    // sampler stays attached (each attachment re-reserves the context): detach forgets it
    bool attach(const clover_seq & s);
    void detach(llama_seq_id seq_id);

    // scratch
    std::vector<candidate> cand;
    prob_list work;
    std::vector<int32_t> order;
    std::vector<float> row;
    std::vector<llama_token_data> tdata;
    std::vector<llama_token> before;
};

clover_batch::~clover_batch() {
    for (size_t i = 0; i < pick.size(); ++i) {
        detach((llama_seq_id) i);
    }
}

bool clover_batch::attach(const clover_seq & s) {
    if ((size_t) s.id >= pick.size()) {
        pick.resize(s.id + 1, nullptr);
        lent.resize(s.id + 1, false);
    }
    if (pick[s.id]) {
        return true;
    }
    // a temperature <= 0 is greedy on either path
    llama_sampler * chain = clover_sampler_init_pick(llama_get_model(ctx), std::max(0.0f, s.p.temperature));
    if (!chain) {
        return false;
    }
    if (!llama_set_sampler(ctx, s.id, chain)) {
        llama_sampler_free(chain);
        return false;
    }
    pick[s.id] = chain;
    return true;
}

void clover_batch::detach(llama_seq_id seq_id) {
    if ((size_t) seq_id < pick.size() && pick[seq_id]) {
        if (!lent[seq_id]) {
            llama_set_sampler(ctx, seq_id, nullptr);
            llama_sampler_free(pick[seq_id]);
        }
        pick[seq_id] = nullptr;
        lent[seq_id] = false;
    }
}

namespace {

void start_block(clover_seq & s, llama_token mask_id) {
    s.L    = std::min(s.B, s.n_max - s.n_gen);
    s.M    = s.L;
    s.T    = s.p.steps > 0 ? std::min(s.p.steps, s.M) : 0;
    s.step = 0;
    s.blk.assign(s.L, mask_id);
    s.prob.assign(s.L, 1.0f);
    s.top_tok.assign((size_t) s.L * s.n_top, -1);
    s.top_p.assign((size_t) s.L * s.n_top, 0.0f);
    s.per_step.clear();
    s.ms_step.clear();
    s.n_acc = 0;
}

// Which rows of a denoising step compute logits: on a CPU only the masked ones (the output
// matmul over a large vocabulary dominates a step); where the output layer runs on an
// accelerator every row (its cost hardly depends on the rows), so that every step of a block
// has the same graph and reuses it.
bool all_rows(const llama_context * ctx) {
    return !llama_model_output_on_host(llama_get_model(ctx));
}

// tokens to unmask at this step of the steps schedule (T > 0): M spread over T steps, the
// earlier taking the remainder; the last scheduled step takes everything left
int32_t scheduled(const clover_seq & s, int32_t n_masked) {
    if (s.step >= s.T - 1) {
        return n_masked;
    }
    return std::min(n_masked, s.M / s.T + (s.step < s.M % s.T ? 1 : 0));
}

void log_nonfinite(const clover_seq & s, int32_t i) {
    CLOVER_LOG_ERROR("clover: non-finite logits in a denoising step (sequence %d, block %d, step %d, position %d)\n",
                    s.id, s.block_index, s.step, i);
}

void unmask(clover_seq & s, clover_batch & b, int32_t i, const candidate & c) {
    s.blk[i]  = c.tok;
    s.prob[i] = c.conf;
    if (s.n_top > 0) {
        top_probs(b.work, s.n_top, &s.top_tok[(size_t) i * s.n_top], &s.top_p[(size_t) i * s.n_top]);
    }
}

// a row's logits, the mask token at -Inf, through the given samplers in order (null ones skipped:
// a sequence's bias sampler, clover_batch_set_bias, then its constraint), into b.row
const float * filtered_row(clover_batch & b, const float * a, int32_t n_vocab, llama_token mask_id,
                           std::initializer_list<llama_sampler *> samplers) {
    b.tdata.resize(n_vocab);
    for (int32_t v = 0; v < n_vocab; ++v) {
        b.tdata[v] = { v, v == mask_id ? -INFINITY : a[v], 0.0f };
    }
    llama_token_data_array arr = { b.tdata.data(), (size_t) n_vocab, -1, false };
    for (llama_sampler * smpl : samplers) {
        if (smpl) {
            llama_sampler_apply(smpl, &arr);
        }
    }
    b.row.assign(n_vocab, -INFINITY);
    for (size_t k = 0; k < arr.size; ++k) {
        const llama_token v = arr.data[k].id;
        if (v >= 0 && v < n_vocab) {
            b.row[v] = arr.data[k].logit;
        }
    }
    return b.row.data();
}

// After a step of a sequence with a bias sampler: the tokens the step unmasked (masked in `before`,
// the block at the step's start) are accepted in position order. Positions a lazy constraint masked
// again leave it: the sampler is reset and what is still unmasked is accepted again, in its order.
void accept_bias(clover_seq & s, const std::vector<llama_token> & before, llama_token mask_id) {
    bool remasked = false;
    for (int32_t i = 0; i < s.L; ++i) {
        if (before[i] == mask_id && s.blk[i] != mask_id) {
            llama_sampler_accept(s.bias, s.blk[i]);
            s.biased.emplace_back(s.n_gen + i, s.blk[i]);
        }
        remasked = remasked || (before[i] != mask_id && s.blk[i] == mask_id);
    }
    if (!remasked) {
        return;
    }
    const auto gone = [&](const std::pair<int32_t, llama_token> & e) {
        return e.first >= s.n_gen && s.blk[e.first - s.n_gen] == mask_id;
    };
    s.biased.erase(std::remove_if(s.biased.begin(), s.biased.end(), gone), s.biased.end());
    llama_sampler_reset(s.bias);
    for (const auto & e : s.biased) {
        llama_sampler_accept(s.bias, e.second);
    }
}

// A constrained sequence's step: left to right from its leftmost masked position (see clover.h).
// row(i) gives position i's logits.
template <typename Row>
int32_t step_constrained(clover_batch & b, clover_seq & s, llama_token mask_id, llama_pos pos0, int32_t n_vocab,
                         Row && row) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(b.ctx));
    const int32_t first = (int32_t) (std::find(s.blk.begin(), s.blk.end(), mask_id) - s.blk.begin());
    const int32_t n_masked = s.L - first;
    const int32_t target = s.T > 0 ? scheduled(s, n_masked) : n_masked;
    const uint64_t step_key = clover_step_key(s.seed, s.block_index, s.step);
    int32_t n = 0;
    for (int32_t i = first; i < s.L && n < target; ++i) {
        const float * a = row(i);
        if (!a) {
            return CLOVER_ERR_OUTPUT;
        }
        if (!row_finite(a, n_vocab)) { // the model's row: the constraint's -Inf come after it
            log_nonfinite(s, i);
            return CLOVER_ERR_NONFINITE;
        }
        // the bias before the constraint filters the row
        const float * f = filtered_row(b, a, n_vocab, mask_id, { s.bias, s.constraint });
        const candidate c = pick_host(f, n_vocab, mask_id, s.p, clover_row_key(step_key, pos0 + i), b.work);
        if (!c.ok) {
            log_nonfinite(s, i);
            return CLOVER_ERR_NONFINITE;
        }
        const bool take = n == 0 || (s.T > 0 || c.conf >= s.p.threshold);
        if (!take) {
            break;
        }
        if (c.tok < 0) { // the constraint allows nothing here: end the sequence
            CLOVER_LOG_WARN("clover: sequence %d: its constraint allows no token at position %d; ending it\n", s.id, i);
            std::fill(s.blk.begin() + i, s.blk.end(), llama_vocab_eos(vocab));
            s.ended = true;
            n = s.L - i;
            break;
        }
        unmask(s, b, i, c);
        llama_sampler_accept(s.constraint, c.tok);
        ++n;
        if (llama_vocab_is_eog(vocab, c.tok)) {
            std::fill(s.blk.begin() + i + 1, s.blk.end(), llama_vocab_eos(vocab));
            s.ended = true;
            break;
        }
    }
    return n;
}

// An unconstrained sequence's step: each masked position's candidate (from the graph, or from
// its logits row on the host), then the schedule unmasks the most confident ones. Positions from
// `lim` on stay masked.
template <typename Pick>
int32_t step_free(clover_batch & b, clover_seq & s, llama_token mask_id, Pick && pick, int32_t lim) {
    b.cand.resize(s.L);
    b.order.clear();
    for (int32_t i = 0; i < lim; ++i) {
        if (s.blk[i] != mask_id) {
            continue;
        }
        const int32_t ret = pick(i, b.cand[i]);
        if (ret != 0) {
            return ret;
        }
        if (!b.cand[i].ok) {
            log_nonfinite(s, i);
            return CLOVER_ERR_NONFINITE;
        }
        b.order.push_back(i);
    }
    // most confident first, ties to the lower position
    std::stable_sort(b.order.begin(), b.order.end(), [&](int32_t x, int32_t y) {
        return b.cand[x].conf > b.cand[y].conf;
    });
    const int32_t n_masked = (int32_t) b.order.size();
    int32_t n_unmask = 0;
    if (s.T > 0) {
        n_unmask = scheduled(s, n_masked);
    } else {
        for (int32_t i : b.order) {
            n_unmask += b.cand[i].conf >= s.p.threshold;
        }
        n_unmask = std::min(std::max(1, n_unmask), n_masked);
    }
    for (int32_t j = 0; j < n_unmask; ++j) {
        const int32_t i = b.order[j];
        s.blk[i]  = b.cand[i].tok;
        s.prob[i] = b.cand[i].conf;
    }
    return n_unmask;
}

// A lazy constraint (clover_batch_set_triggers) filters nothing before its trigger, so until then
// the sequence steps as an unconstrained one, except after a trigger token: what follows it is the
// constraint's, unmasked left to right once the positions before it are known.
int32_t first_trigger(const clover_seq & s) {
    for (int32_t i = 0; i < s.L; ++i) {
        if (std::find(s.triggers.begin(), s.triggers.end(), s.blk[i]) != s.triggers.end()) {
            return i;
        }
    }
    return s.L;
}

// After a lazy sequence's step: positions after the block's first trigger token are masked again
// (they were chosen without the constraint), and the known prefix is accepted into the sampler; the
// trigger switches the sequence to constrained steps, an end-of-generation token ends it.
void accept_lazy(clover_seq & s, llama_token mask_id, const llama_vocab * vocab) {
    const int32_t t = first_trigger(s);
    for (int32_t j = t + 1; j < s.L; ++j) {
        s.blk[j] = mask_id;
    }
    while (s.n_acc < s.L && s.blk[s.n_acc] != mask_id) {
        const llama_token tok = s.blk[s.n_acc++];
        llama_sampler_accept(s.constraint, tok);
        if (s.n_acc - 1 == t) {
            s.lazy = false;
            return;
        }
        if (llama_vocab_is_eog(vocab, tok)) {
            std::fill(s.blk.begin() + s.n_acc, s.blk.end(), llama_vocab_eos(vocab));
            s.ended = true;
            return;
        }
    }
}

// one denoising step for the given sequences (same pick mode): one decode
int32_t denoise_group(clover_batch & b, const std::vector<clover_seq *> & group, llama_token mask_id,
                      clover_perf & perf) {
    llama_context * ctx = b.ctx;
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const bool every_row = all_rows(ctx);
    bool on_device = !group[0]->on_host();
    for (auto * s : group) {
        on_device = on_device && b.attach(*s);
    }
    if (!on_device) {
        for (auto * s : group) {
            if ((size_t) s->id < b.lent.size() && b.lent[s->id]) {
                CLOVER_LOG_ERROR("%s: sequence %d computes its candidates on the host but has a lent pick sampler\n", __func__, s->id);
                return CLOVER_ERR_ARG;
            }
            b.detach(s->id); // the rows' logits come to the host
        }
    }

    int32_t n_tok = 0;
    for (auto * s : group) {
        n_tok += s->L;
    }
    llama_batch batch = llama_batch_init(n_tok, 0, 1);
    std::vector<llama_pos> pos0(group.size());
    std::vector<int32_t> row0(group.size()); // output index of each sequence's first row
    int32_t t = 0;
    for (size_t g = 0; g < group.size(); ++g) {
        clover_seq & s = *group[g];
        pos0[g] = next_pos(ctx, s.id);
        row0[g] = t;
        for (int32_t i = 0; i < s.L; ++i, ++t) {
            batch.token[t]     = s.blk[i];
            batch.pos[t]       = pos0[g] + i;
            batch.n_seq_id[t]  = 1;
            batch.seq_id[t][0] = s.id;
            batch.logits[t]    = every_row || s.blk[i] == mask_id;
        }
        if (on_device) {
            pick_set_keys(pick_of(b.pick[s.id]), clover_step_key(s.seed, s.block_index, s.step), pos0[g],
                          batch.logits + row0[g], s.L);
        }
    }
    batch.n_tokens = n_tok;

    const double  t0        = now_ms();
    int64_t build0 = 0, compute0 = 0;
    int32_t n_builds0 = 0;
    llama_perf_context_graph(ctx, &build0, &compute0, &n_builds0);

    int32_t ret = decode(ctx, batch, /*denoise*/ true, 0);
    llama_batch_free(batch);
    for (size_t g = 0; g < group.size(); ++g) {
        undo_advance(ctx, group[g]->id, pos0[g], group[g]->L);
    }
    if (ret != 0) {
        return ret;
    }
    const double t1 = now_ms();

    // candidates, then the schedule
    for (size_t g = 0; g < group.size(); ++g) {
        clover_seq & s = *group[g];
        const uint64_t step_key = clover_step_key(s.seed, s.block_index, s.step);
        auto row = [&](int32_t i) { return llama_get_logits_ith(ctx, row0[g] + i); };
        int32_t n;
        if (s.bias) {
            b.before = s.blk;
        }
        if (s.constraint && s.lazy) {
            accept_lazy(s, mask_id, vocab); // positions given before the first step
        }
        if (s.constraint && !s.lazy) {
            n = step_constrained(b, s, mask_id, pos0[g], n_vocab, row);
        } else {
            const int32_t lim = s.constraint ? first_trigger(s) : s.L;
            n = step_free(b, s, mask_id, [&](int32_t i, candidate & c) {
                if (on_device) {
                    const llama_token tok  = llama_get_sampled_token_ith(ctx, row0[g] + i);
                    const float *     conf = llama_get_sampled_probs_ith(ctx, row0[g] + i);
                    if (tok == LLAMA_TOKEN_NULL || !conf) {
                        return (int32_t) CLOVER_ERR_OUTPUT;
                    }
                    c = { tok, conf[0], std::isfinite(conf[0]) };
                    return (int32_t) CLOVER_OK;
                }
                const float * a = row(i);
                if (!a) {
                    return (int32_t) CLOVER_ERR_OUTPUT;
                }
                if (!row_finite(a, n_vocab)) {
                    c.ok = false;
                    return (int32_t) CLOVER_OK;
                }
                if (s.bias) {
                    a = filtered_row(b, a, n_vocab, mask_id, { s.bias });
                }
                c = pick_host(a, n_vocab, mask_id, s.p, clover_row_key(step_key, pos0[g] + i), b.work);
                if (c.ok && s.n_top > 0) {
                    top_probs(b.work, s.n_top, &s.top_tok[(size_t) i * s.n_top], &s.top_p[(size_t) i * s.n_top]);
                }
                return (int32_t) CLOVER_OK;
            }, lim);
            if (s.constraint && n >= 0) {
                accept_lazy(s, mask_id, vocab);
            }
        }
        if (n < 0) {
            return n;
        }
        if (s.bias) {
            accept_bias(s, b.before, mask_id);
        }
        s.per_step.push_back(n);
        s.step++;
    }
    const double t2 = now_ms();

    int64_t build1 = 0, compute1 = 0;
    int32_t n_builds1 = 0;
    llama_perf_context_graph(ctx, &build1, &compute1, &n_builds1);
    const double graph_ms   = (build1   - build0)   / 1e3;
    const double compute_ms = (compute1 - compute0) / 1e3;
    perf.n_steps        += 1;
    perf.n_steps_device += on_device;
    perf.n_step_graphs  += n_builds1 - n_builds0;
    perf.t_step_graph_ms   += graph_ms;
    perf.t_step_compute_ms += compute_ms;
    perf.t_step_host_ms    += t2 - t1;
    perf.t_step_other_ms   += std::max(0.0, (t1 - t0) - graph_ms - compute_ms);
    for (auto * s : group) {
        s->ms_step.push_back((float) (t2 - t0));
    }
    return 0;
}

// the block of s is complete: report it, then commit it or end the sequence
int32_t finish_block(clover_batch & b, clover_seq & s, llama_token eos_id, clover_seq_block_cb cb, void * ud,
                     clover_perf & perf) {
    perf.n_blocks++;
    perf.n_gen += s.L;
    s.n_gen += s.L;
    for (int32_t i = 0; i < s.L && !s.eos; ++i) {
        if (s.blk[i] == eos_id) {
            s.eos = true;
        } else {
            s.out.push_back(s.blk[i]);
        }
    }
    bool go_on = true;
    if (cb) {
        clover_block_stats st;
        st.block_index     = s.block_index;
        st.n_tokens        = s.L;
        st.n_steps         = (int32_t) s.per_step.size();
        st.tokens_per_step = s.per_step.data();
        st.ms_per_step     = s.ms_step.data();
        st.tokens          = s.blk.data();
        st.probs           = s.prob.data();
        st.n_top           = s.n_top;
        st.top_tokens      = s.top_tok.data();
        st.top_probs       = s.top_p.data();
        go_on = cb(s.id, &st, ud);
    }
    if (s.eos || s.ended || !go_on || s.n_gen >= s.n_max) {
        s.active = false; // the final block is not committed
        return 0;
    }
    const double tc = now_ms();
    const int32_t ret = commit_seq(b.ctx, s.id, s.blk.data(), s.L, s.L);
    perf.t_commit_ms += now_ms() - tc;
    if (ret != 0) {
        return ret;
    }
    s.block_index++;
    start_block(s, llama_vocab_mask(llama_model_get_vocab(llama_get_model(b.ctx))));
    return 0;
}

int32_t batch_step(clover_batch & b, clover_seq_block_cb cb, void * ud, clover_step_cb step_cb, void * step_ud) {
    llama_context * ctx = b.ctx;
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const llama_token mask_id = llama_vocab_mask(vocab);
    const llama_token eos_id  = llama_vocab_eos(vocab);
    clover_perf & perf = perf_of(ctx);
    const double t0 = now_ms();

    // a sequence that ended gives its sampler back (an attached sampler runs in every graph)
    for (size_t i = 0; i < b.pick.size(); ++i) {
        if (b.pick[i] && (i >= b.seqs.size() || !b.seqs[i].active)) {
            b.detach((llama_seq_id) i);
        }
    }

    // one decode per (pick mode, block length) group of at most one ubatch of
    // tokens: usually all active sequences together. llama_decode splits a batch whose sequences
    // differ in length, or that exceeds n_ubatch, into ubatches that cut blocks into pieces.
    std::vector<clover_seq *> pending;
    for (auto & s : b.seqs) {
        if (s.active) {
            pending.push_back(&s);
        }
    }
    const int32_t cap = n_cap(ctx);
    while (!pending.empty()) {
        std::vector<clover_seq *> group, rest;
        int32_t n_tok = 0;
        for (auto * s : pending) {
            const bool same = s->on_host() == pending[0]->on_host() &&
                              s->L == pending[0]->L && n_tok + s->L <= cap;
            (same ? group : rest).push_back(s);
            n_tok += same ? s->L : 0;
        }
        const int32_t ret = denoise_group(b, group, mask_id, perf);
        if (ret != 0) {
            return ret;
        }
        pending.swap(rest);
    }

    int32_t n_active = 0;
    for (auto & s : b.seqs) {
        if (!s.active) {
            continue;
        }
        if (step_cb && !step_cb(s.block_index, s.step - 1, s.blk.data(), s.L, step_ud)) {
            s.active = false;
            continue;
        }
        const bool complete = std::find(s.blk.begin(), s.blk.end(), mask_id) == s.blk.end();
        if (complete) {
            const int32_t ret = finish_block(b, s, eos_id, cb, ud, perf);
            if (ret != 0) {
                return ret;
            }
        }
        n_active += s.active;
    }
    perf.t_gen_ms += now_ms() - t0;
    return n_active;
}

int32_t batch_add(clover_batch & b, llama_seq_id seq_id, const llama_token * prompt, int32_t n_prompt,
                  clover_gen_params params, bool keep_memory, int32_t n_out_max) {
    llama_context * ctx = b.ctx;
    if (seq_id < 0 || seq_id >= (llama_seq_id) llama_n_seq_max(ctx)) {
        CLOVER_LOG_ERROR("%s: seq_id %d outside [0, n_seq_max = %u)\n", __func__, seq_id, llama_n_seq_max(ctx));
        return CLOVER_ERR_ARG;
    }
    if (n_prompt < 0 || (n_prompt > 0 && !prompt)) {
        return CLOVER_ERR_ARG;
    }
    if ((size_t) seq_id >= b.seqs.size()) {
        b.seqs.resize(seq_id + 1);
    }
    clover_seq & s = b.seqs[seq_id];
    if (s.active) {
        CLOVER_LOG_ERROR("%s: sequence %d is already generating\n", __func__, seq_id);
        return CLOVER_ERR_ARG;
    }
    const llama_token mask_id = llama_vocab_mask(llama_model_get_vocab(llama_get_model(ctx)));
    if (mask_id < 0) {
        CLOVER_LOG_ERROR("%s: the model has no mask token (tokenizer.ggml.mask_token_id)\n", __func__);
        return CLOVER_ERR_NO_MASK;
    }
    const int32_t B = resolve_block(ctx, params.block_size);
    if (B <= 0 || B > n_cap(ctx)) {
        CLOVER_LOG_ERROR("%s: block size %d must be in [1, min(n_ubatch, n_batch) = %d]\n", __func__, B, n_cap(ctx));
        return CLOVER_ERR_BLOCK;
    }
    b.detach(seq_id); // made for the sequence's previous parameters
    s = clover_seq();
    s.id    = seq_id;
    s.p     = params;
    s.B     = B;
    s.n_max = params.max_new_tokens > 0 ? std::min(params.max_new_tokens, n_out_max) : n_out_max;
    s.seed  = params.seed;

    if (!keep_memory) {
        llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1);
    }
    clover_perf & perf = perf_of(ctx);
    const double t0 = now_ms();
    if (n_prompt > 0) {
        const int32_t ret = commit_seq(ctx, seq_id, prompt, n_prompt, B);
        if (ret != 0) {
            return ret;
        }
    }
    perf.t_prompt_ms += now_ms() - t0;
    perf.n_prompt    += n_prompt;

    s.active = s.n_max > 0;
    if (s.active) {
        start_block(s, mask_id);
    }
    return 0;
}

// seq_id, active and before its first denoising step (the setters' precondition), else nullptr
clover_seq * fresh_seq(clover_batch * b, llama_seq_id seq_id) {
    if (!b || seq_id < 0 || (size_t) seq_id >= b->seqs.size()) {
        return nullptr;
    }
    clover_seq & s = b->seqs[seq_id];
    return s.active && s.step == 0 ? &s : nullptr;
}

} // namespace

extern "C" {

struct clover_gen_params clover_gen_default_params(void) {
    clover_gen_params p;
    p.block_size     = 0;
    p.steps          = 0;
    p.threshold      = 0.9f;
    p.temperature    = 0.0f;
    p.top_k          = 0;
    p.top_p          = 1.0f;
    p.seed           = 0;
    p.max_new_tokens = 128;
    return p;
}

uint64_t clover_step_key(uint64_t seed, int32_t block_index, int32_t step) {
    return clover_mix64(clover_mix64(seed) ^ (((uint64_t) (uint32_t) block_index << 32) | (uint32_t) step));
}

uint64_t clover_row_key(uint64_t step_key, llama_pos pos) {
    return clover_mix64(step_key ^ (uint64_t) (uint32_t) pos);
}

int32_t clover_model_block_size(const struct llama_model * model) {
    if (!is_clover_model(model)) {
        return CLOVER_ERR_ARG;
    }
    return (int32_t) meta_int(model, "clover.diffusion.block_size");
}

int32_t clover_reset(struct llama_context * ctx) {
    return guarded(__func__, [&]() -> int32_t {
        if (!require_clover(ctx, __func__)) {
            return CLOVER_ERR_ARG;
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        return 0;
    });
}

int32_t clover_n_committed(struct llama_context * ctx) {
    return guarded(__func__, [&]() -> int32_t {
        return is_clover(ctx) ? (int32_t) next_pos(ctx, 0) : -1;
    });
}

int32_t clover_commit(struct llama_context * ctx, const llama_token * tokens, int32_t n_tokens, int32_t block_size) {
    return guarded(__func__, [&]() -> int32_t {
        if (!require_clover(ctx, __func__)) {
            return CLOVER_ERR_ARG;
        }
        if (n_tokens < 0 || (n_tokens > 0 && !tokens)) {
            return CLOVER_ERR_ARG;
        }
        return commit_seq(ctx, 0, tokens, n_tokens, resolve_block(ctx, block_size));
    });
}

int32_t clover_block_logits(struct llama_context * ctx, const llama_token * block, int32_t n_block, float * logits_out) {
    return guarded(__func__, [&]() -> int32_t {
        if (!require_clover(ctx, __func__)) {
            return CLOVER_ERR_ARG;
        }
        if (n_block <= 0 || !block) {
            return CLOVER_ERR_ARG;
        }
        if (n_block > n_cap(ctx)) {
            CLOVER_LOG_ERROR("%s: block of %d tokens exceeds min(n_ubatch, n_batch) = %d\n", __func__, n_block, n_cap(ctx));
            return CLOVER_ERR_BLOCK;
        }
        const llama_pos pos0 = next_pos(ctx, 0);
        std::vector<int8_t> rows(n_block, 1);
        llama_batch batch = seq_batch(block, n_block, 0, pos0, rows.data());
        const int32_t ret = decode(ctx, batch, /*denoise*/ true, 0);
        llama_batch_free(batch);
        undo_advance(ctx, 0, pos0, n_block);
        if (ret != 0) {
            return ret;
        }
        if (logits_out) {
            const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
            for (int32_t i = 0; i < n_block; ++i) {
                const float * row = llama_get_logits_ith(ctx, i);
                if (!row) {
                    return CLOVER_ERR_OUTPUT;
                }
                memcpy(logits_out + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
            }
        }
        return 0;
    });
}

struct llama_sampler * clover_sampler_init_pick(const struct llama_model * model, float temperature) {
    if (!is_clover_model(model) || !(temperature >= 0.0f)) {
        CLOVER_LOG_ERROR("%s: not a clover model, or temperature %g < 0\n", __func__, temperature);
        return nullptr;
    }
    try {
        llama_sampler * chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
        llama_sampler_chain_add(chain, pick_init(temperature, llama_vocab_mask(llama_model_get_vocab(model))));
        return chain;
    } catch (const std::exception & e) {
        CLOVER_LOG_ERROR("%s: %s\n", __func__, e.what());
        return nullptr;
    }
}

int32_t clover_block_candidates(struct llama_context * ctx, struct llama_sampler * smpl, const llama_token * block,
                                int32_t n_block, uint64_t step_key, llama_token * tok_out, float * conf_out) {
    return guarded(__func__, [&]() -> int32_t {
        if (!require_clover(ctx, __func__)) {
            return CLOVER_ERR_ARG;
        }
        pick_sampler * pick = pick_of(smpl);
        if (!pick) {
            CLOVER_LOG_ERROR("%s: not a sampler of clover_sampler_init_pick\n", __func__);
            return CLOVER_ERR_ARG;
        }
        if (n_block <= 0 || !block || !tok_out || !conf_out) {
            return CLOVER_ERR_ARG;
        }
        if (n_block > n_cap(ctx)) {
            CLOVER_LOG_ERROR("%s: block of %d tokens exceeds min(n_ubatch, n_batch) = %d\n", __func__, n_block, n_cap(ctx));
            return CLOVER_ERR_BLOCK;
        }
        const llama_token mask_id = llama_vocab_mask(llama_model_get_vocab(llama_get_model(ctx)));
        std::vector<int8_t> rows(n_block);
        for (int32_t i = 0; i < n_block; ++i) {
            rows[i] = block[i] == mask_id;
        }
        const llama_pos pos0 = next_pos(ctx, 0);
        llama_batch batch = seq_batch(block, n_block, 0, pos0, rows.data());
        pick_set_keys(pick, step_key, pos0, rows.data(), n_block);
        const int32_t ret = decode(ctx, batch, /*denoise*/ true, 0);
        llama_batch_free(batch);
        undo_advance(ctx, 0, pos0, n_block);
        if (ret != 0) {
            return ret;
        }
        for (int32_t i = 0; i < n_block; ++i) {
            if (!rows[i]) {
                continue;
            }
            const llama_token tok  = llama_get_sampled_token_ith(ctx, i);
            const float *     conf = llama_get_sampled_probs_ith(ctx, i);
            if (tok == LLAMA_TOKEN_NULL || !conf) {
                CLOVER_LOG_ERROR("%s: no candidate for row %d: is the sampler attached to sequence 0 (llama_set_sampler)?\n", __func__, i);
                return CLOVER_ERR_OUTPUT;
            }
            tok_out[i]  = tok;
            conf_out[i] = conf[0];
        }
        return 0;
    });
}

struct clover_batch * clover_batch_init(struct llama_context * ctx) {
    if (!require_clover(ctx, __func__)) {
        return nullptr;
    }
    try {
        auto * b = new clover_batch();
        b->ctx = ctx;
        return b;
    } catch (...) {
        return nullptr;
    }
}

void clover_batch_free(struct clover_batch * batch) {
    delete batch;
}

int32_t clover_batch_add(struct clover_batch * batch, llama_seq_id seq_id, const llama_token * prompt,
                         int32_t n_prompt, struct clover_gen_params params, bool keep_memory) {
    return guarded(__func__, [&]() -> int32_t {
        return batch ? batch_add(*batch, seq_id, prompt, n_prompt, params, keep_memory, INT32_MAX) : -1;
    });
}

int32_t clover_batch_step(struct clover_batch * batch, clover_seq_block_cb cb, void * user_data) {
    return guarded(__func__, [&]() -> int32_t {
        return batch ? batch_step(*batch, cb, user_data, nullptr, nullptr) : -1;
    });
}

int32_t clover_batch_set_constraint(struct clover_batch * batch, llama_seq_id seq_id, struct llama_sampler * smpl) {
    clover_seq * s = fresh_seq(batch, seq_id);
    if (!s) {
        return CLOVER_ERR_ARG;
    }
    s->constraint = smpl;
    return CLOVER_OK;
}

int32_t clover_batch_set_triggers(struct clover_batch * batch, llama_seq_id seq_id, const llama_token * tokens,
                                  int32_t n_tokens) {
    clover_seq * s = fresh_seq(batch, seq_id);
    if (!s || n_tokens < 0 || (n_tokens > 0 && !tokens)) {
        return CLOVER_ERR_ARG;
    }
    s->triggers.assign(tokens, tokens + n_tokens);
    s->lazy = n_tokens > 0;
    return CLOVER_OK;
}

int32_t clover_batch_set_top_probs(struct clover_batch * batch, llama_seq_id seq_id, int32_t n_top) {
    clover_seq * s = fresh_seq(batch, seq_id);
    if (!s || n_top < 0 || n_top > CLOVER_MAX_TOP_PROBS) {
        return CLOVER_ERR_ARG;
    }
    s->n_top = n_top;
    s->top_tok.assign((size_t) s->L * n_top, -1);
    s->top_p.assign((size_t) s->L * n_top, 0.0f);
    return CLOVER_OK;
}

int32_t clover_batch_set_block(struct clover_batch * batch, llama_seq_id seq_id, const llama_token * block, int32_t n_block) {
    return guarded(__func__, [&]() -> int32_t {
        clover_seq * s = fresh_seq(batch, seq_id);
        if (!s || !block || n_block <= 0) {
            return CLOVER_ERR_ARG;
        }
        if (n_block > n_cap(batch->ctx)) {
            CLOVER_LOG_ERROR("%s: block of %d tokens exceeds min(n_ubatch, n_batch) = %d\n", __func__, n_block, n_cap(batch->ctx));
            return CLOVER_ERR_BLOCK;
        }
        const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(batch->ctx));
        const int32_t n_vocab = llama_vocab_n_tokens(vocab);
        const llama_token mask_id = llama_vocab_mask(vocab);
        for (int32_t i = 0; i < n_block; ++i) {
            if (block[i] < 0 || block[i] >= n_vocab) {
                CLOVER_LOG_ERROR("%s: token %d at position %d outside the vocabulary\n", __func__, block[i], i);
                return CLOVER_ERR_ARG;
            }
        }
        s->n_max = std::max(s->n_max, s->n_gen + n_block);
        s->L = n_block;
        s->blk.assign(block, block + n_block);
        s->M = (int32_t) std::count(s->blk.begin(), s->blk.end(), mask_id);
        s->T = s->p.steps > 0 ? std::min(s->p.steps, std::max(1, s->M)) : 0;
        s->prob.assign(n_block, 1.0f);
        s->top_tok.assign((size_t) n_block * s->n_top, -1);
        s->top_p.assign((size_t) n_block * s->n_top, 0.0f);
        return CLOVER_OK;
    });
}

int32_t clover_batch_set_bias(struct clover_batch * batch, llama_seq_id seq_id, struct llama_sampler * smpl) {
    clover_seq * s = fresh_seq(batch, seq_id);
    if (!s) {
        return CLOVER_ERR_ARG;
    }
    s->bias = smpl;
    s->biased.clear();
    return CLOVER_OK;
}

int32_t clover_batch_set_pick(struct clover_batch * batch, llama_seq_id seq_id, struct llama_sampler * smpl) {
    clover_seq * s = fresh_seq(batch, seq_id);
    const pick_sampler * pick = pick_of(smpl);
    if (!s || !pick) {
        return CLOVER_ERR_ARG;
    }
    if (s->on_host() || pick->temperature != std::max(0.0f, s->p.temperature)) {
        CLOVER_LOG_ERROR("%s: sequence %d computes its candidates on the host or at another temperature than the sampler's\n", __func__, seq_id);
        return CLOVER_ERR_ARG;
    }
    batch->detach(seq_id);
    if ((size_t) seq_id >= batch->pick.size()) {
        batch->pick.resize(seq_id + 1, nullptr);
        batch->lent.resize(seq_id + 1, false);
    }
    batch->pick[seq_id] = smpl;
    batch->lent[seq_id] = true;
    return CLOVER_OK;
}

int32_t clover_batch_on_host(struct clover_batch * batch, llama_seq_id seq_id) {
    if (!batch || seq_id < 0 || (size_t) seq_id >= batch->seqs.size() || !batch->seqs[seq_id].active) {
        return CLOVER_ERR_ARG;
    }
    return batch->seqs[seq_id].on_host() ? 1 : 0;
}

int32_t clover_batch_remove(struct clover_batch * batch, llama_seq_id seq_id) {
    if (!batch || seq_id < 0 || (size_t) seq_id >= batch->seqs.size() || !batch->seqs[seq_id].active) {
        return CLOVER_ERR_ARG;
    }
    batch->seqs[seq_id].active = false;
    return 0;
}

int32_t clover_batch_tokens(struct clover_batch * batch, llama_seq_id seq_id, llama_token * out, int32_t n_max) {
    if (!batch || seq_id < 0 || (size_t) seq_id >= batch->seqs.size()) {
        return CLOVER_ERR_ARG;
    }
    const auto & v = batch->seqs[seq_id].out;
    if (out) {
        std::copy_n(v.begin(), std::min<size_t>(v.size(), (size_t) std::max(0, n_max)), out);
    }
    return (int32_t) v.size();
}

int32_t clover_generate_ex(struct llama_context * ctx, const llama_token * prompt, int32_t n_prompt,
                           struct clover_gen_params params, llama_token * out, int32_t n_out_max,
                           clover_block_cb cb, clover_step_cb step_cb, void * user_data) {
    return guarded(__func__, [&]() -> int32_t {
        if (!require_clover(ctx, __func__)) {
            return CLOVER_ERR_ARG;
        }
        if (n_out_max < 0 || (n_out_max > 0 && !out)) {
            return CLOVER_ERR_ARG;
        }
        clover_perf_reset(ctx);
        clover_reset(ctx);

        clover_batch b;
        b.ctx = ctx;
        int32_t ret = batch_add(b, 0, prompt, n_prompt, params, /*keep_memory*/ false, n_out_max);
        if (ret != 0) {
            return ret;
        }
        struct ud_t { clover_block_cb cb; void * ud; } ud = { cb, user_data };
        auto seq_cb = [](llama_seq_id, const clover_block_stats * st, void * p) {
            const auto * u = (const ud_t *) p;
            return u->cb ? u->cb(st, u->ud) : true;
        };
        while ((ret = batch_step(b, seq_cb, &ud, step_cb, user_data)) > 0) {
        }
        if (ret < 0) {
            return ret;
        }
        const auto & toks = b.seqs[0].out;
        const int32_t n = std::min<int32_t>((int32_t) toks.size(), n_out_max);
        std::copy_n(toks.begin(), n, out);
        return n;
    });
}

int32_t clover_generate(struct llama_context * ctx, const llama_token * prompt, int32_t n_prompt,
                        struct clover_gen_params params, llama_token * out, int32_t n_out_max,
                        clover_block_cb cb, void * user_data) {
    return clover_generate_ex(ctx, prompt, n_prompt, params, out, n_out_max, cb, nullptr, user_data);
}

int32_t clover_get_perf(struct llama_context * ctx, struct clover_perf * perf) {
    if (!is_clover(ctx) || !perf) {
        return CLOVER_ERR_ARG;
    }
    *perf = perf_of(ctx);
    return 0;
}

void clover_perf_reset(struct llama_context * ctx) {
    if (is_clover(ctx)) {
        perf_of(ctx) = clover_perf{};
    }
}

int32_t clover_get_state(struct llama_context * ctx, int32_t il, float * dst, size_t n_floats) {
    return guarded(__func__, [&]() -> int32_t {
        if (!is_clover(ctx)) {
            return CLOVER_ERR_ARG;
        }
        const llama_model * model = llama_get_model(ctx);
        const int32_t n_layer = llama_model_n_layer(model);
        if (il < 0 || il >= n_layer) {
            return CLOVER_ERR_BLOCK;
        }
        const int64_t Hkv = llama_model_n_head_kv(model);
        const int64_t D   = meta_int(model, "clover.attention.key_length");
        const int64_t n   = Hkv * D * D;
        if (Hkv <= 0 || D <= 0) {
            return CLOVER_ERR_ARG;
        }
        if (!dst || n_floats < (size_t) n) {
            return (int32_t) n;
        }
        // sequence 0's state as llama_state_seq_get_data writes it (llama-memory-recurrent's
        // state_write): magic, seq id, cell count, per cell (pos, n_seq_id = 0), s_trans, n_layer,
        // per layer the conv rows (type, row size, rows), then per layer the memory rows
        std::vector<uint8_t> buf(llama_state_seq_get_size(ctx, 0));
        if (buf.empty() || llama_state_seq_get_data(ctx, buf.data(), buf.size(), 0) != buf.size()) {
            return CLOVER_ERR_OUTPUT;
        }
        size_t off = 0;
        auto take = [&](void * out, size_t size) {
            if (off + size > buf.size()) {
                throw std::runtime_error("the sequence state is shorter than its layout");
            }
            if (out) {
                memcpy(out, buf.data() + off, size);
            }
            off += size;
        };
        uint32_t u32 = 0, n_cells = 0;
        take(&u32, sizeof(u32));     // magic
        take(nullptr, sizeof(int32_t)); // seq id
        take(&n_cells, sizeof(n_cells));
        if (n_cells == 0 || llama_memory_seq_pos_max(llama_get_memory(ctx), 0) < 0) {
            std::fill(dst, dst + n, 0.0f); // a sequence without history has the zero state
            return (int32_t) n;
        }
        if (n_cells != 1) {
            return CLOVER_ERR_OUTPUT;
        }
        take(nullptr, sizeof(llama_pos));
        take(&u32, sizeof(u32)); // n_seq_id (0 when one sequence is written)
        uint32_t s_trans = 0, n_layer_state = 0;
        take(&s_trans, sizeof(s_trans));
        take(&n_layer_state, sizeof(n_layer_state));
        if (s_trans != 0 || n_layer_state != (uint32_t) n_layer) {
            return CLOVER_ERR_OUTPUT;
        }
        uint64_t row = 0;
        for (int32_t l = 0; l < n_layer; ++l) { // the conv rows
            take(nullptr, sizeof(int32_t));
            take(&row, sizeof(row));
            take(nullptr, row);
        }
        std::vector<float> s(n);
        for (int32_t l = 0; l <= il; ++l) {
            int32_t type = 0;
            take(&type, sizeof(type));
            take(&row, sizeof(row));
            if (type != GGML_TYPE_F32 || row != (uint64_t) n * sizeof(float)) {
                return CLOVER_ERR_OUTPUT;
            }
            take(l == il ? s.data() : nullptr, row);
        }
        // ggml layout: [g][j (v)][i (k)] -> [g][i (k)][j (v)]
        for (int64_t g = 0; g < Hkv; ++g) {
            for (int64_t i = 0; i < D; ++i) {
                for (int64_t j = 0; j < D; ++j) {
                    dst[(g*D + i)*D + j] = s[(g*D + j)*D + i];
                }
            }
        }
        return (int32_t) n;
    });
}

} // extern "C"
