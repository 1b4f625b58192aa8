#ifndef CLOVER_H
#define CLOVER_H

// Clover block-diffusion generation on top of llama.cpp (arch "clover"): libclover, a library
// beside the tools (as llama-diffusion is) built on llama.h's public API.
//
// Context requirements (llama_context_params):
//   n_seq_max >= the sequences used at once (clover_generate uses sequence 0)
//   n_outputs_max_per_seq = 0 (or >= B): a denoising step's rows go through one backend sampler
//   n_ubatch  >= B       a block must fit in one ubatch (B = block size used);
//                        n_ubatch = k*B lets clover_commit fold k prompt blocks per graph, and
//                        n_ubatch >= n*B lets one denoising graph hold n sequences' blocks
//   n_batch   >= n_ubatch
//   n_ctx     any value >= n_ubatch (the memory is a fixed-size recurrent state)
// The memory state of a sequence is its Clover memory: clover_reset clears it, clover_commit folds
// blocks into it, clover_block_logits reads it and leaves it bit-for-bit unchanged.
// A clover context is driven through this API only: llama_decode refuses it unless a driver set
// llama_set_block_diffusion.
// Semantics (confidence, schedules, sampling noise, EOS) follow docs/CONTRACTS.md of clover-gguf.
// Every function returns an error code (< 0) rather than throwing or aborting.

#include "llama.h"

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef CLOVER_SHARED
#    if defined(_WIN32) && !defined(__MINGW32__)
#        ifdef CLOVER_BUILD
#            define CLOVER_API __declspec(dllexport)
#        else
#            define CLOVER_API __declspec(dllimport)
#        endif
#    else
#        define CLOVER_API __attribute__ ((visibility ("default")))
#    endif
#else
#    define CLOVER_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// error codes (every function returns 0 or a count on success)
enum clover_status {
    CLOVER_OK            =   0,
    CLOVER_ERR_ARG       =  -1, // a bad argument, or not a clover context / model
    CLOVER_ERR_BLOCK     =  -2, // a block larger than min(n_ubatch, n_batch)
    CLOVER_ERR_OUTPUT    =  -3, // llama.cpp returned no output row where one was requested
    CLOVER_ERR_NO_MASK   =  -4, // the model has no mask token
    CLOVER_ERR_NONFINITE =  -6, // a denoising step's logits are not finite (NaN or Inf)
    CLOVER_ERR_EXCEPTION = -10, // an exception inside llama.cpp (logged)
    // llama_decode's own failures are returned as they are (< 0) or as -100 - code (> 0)
};

#define CLOVER_MAX_TOP_PROBS 64

struct clover_gen_params {
    int32_t  block_size;     // block size B; <= 0: the model's clover.diffusion.block_size
    int32_t  steps;          // > 0: LLaDA steps schedule (clamped to the block length); 0: threshold schedule
    float    threshold;      // threshold schedule: unmask every masked position with confidence >= threshold (at least one)
    float    temperature;    // 0: greedy (argmax)
    int32_t  top_k;          // <= 0: disabled
    float    top_p;          // >= 1 or <= 0: disabled
    uint32_t seed;           // seed of the sampling noise (temperature > 0)
    int32_t  max_new_tokens; // <= 0: up to n_out_max
};

struct clover_block_stats {
    int32_t             block_index;     // 0-based index of the generated block
    int32_t             n_tokens;        // block length L
    int32_t             n_steps;         // denoising steps used for this block
    const int32_t     * tokens_per_step; // [n_steps] positions unmasked at each step
    const float       * ms_per_step;     // [n_steps] wall time of each step (forward + selection), ms
    const llama_token * tokens;          // [n_tokens] the final block (before EOS truncation)
    // appended fields (older callers read only the ones above)
    const float       * probs;           // [n_tokens] each position's probability at the step that unmasked it
                                         // (the confidence; 1 for positions given by clover_batch_set_block)
    int32_t             n_top;           // alternatives per position (clover_batch_set_top_probs), else 0
    const llama_token * top_tokens;      // [n_tokens * n_top] most probable tokens at that step, best first
    const float       * top_probs;       // [n_tokens * n_top] their probabilities (0 for fixed positions)
};

// called after each generated block; return false to stop generation
typedef bool (*clover_block_cb)(const struct clover_block_stats * stats, void * user_data);

// called after each denoising step with the current block (masked positions hold the mask token);
// return false to stop generation
typedef bool (*clover_step_cb)(int32_t block_index, int32_t step, const llama_token * block, int32_t n_block, void * user_data);

// with several sequences: the block callback also names the sequence
typedef bool (*clover_seq_block_cb)(llama_seq_id seq_id, const struct clover_block_stats * stats, void * user_data);

struct clover_perf {
    double  t_prompt_ms;  // prefill (commit of the prompt)
    int32_t n_prompt;
    double  t_gen_ms;     // generation (denoising steps + commits of generated blocks)
    int32_t n_gen;        // tokens generated (before EOS truncation)
    int32_t n_steps;      // denoising steps (forward passes) in total
    int32_t n_blocks;     // generated blocks
    double  t_commit_ms;  // time spent committing generated blocks (included in t_gen_ms)
    // breakdown of the denoising steps (sums over n_steps)
    double  t_step_graph_ms;   // graph construction + allocation (0 when the graph is reused)
    double  t_step_compute_ms; // graph compute
    double  t_step_host_ms;    // candidate selection and scheduling on the host
    double  t_step_other_ms;   // the rest of each step: outputs to the host, synchronisation, batch setup
    int32_t n_step_graphs;     // steps that built a new graph (the others reused the previous one)
    int32_t n_steps_device;    // steps whose candidates were computed on the device (ggml_gumbel_argmax)
};

CLOVER_API struct clover_gen_params clover_gen_default_params(void);

// default decoding block size stored in the GGUF (clover.diffusion.block_size), -1 if not a clover model
CLOVER_API int32_t clover_model_block_size(const struct llama_model * model);

// clear the memory state of sequence 0; returns 0
CLOVER_API int32_t clover_reset(struct llama_context * ctx);

// number of committed positions of sequence 0 (the next block starts at this position)
CLOVER_API int32_t clover_n_committed(struct llama_context * ctx);

// prefill: commit n_tokens tokens to sequence 0 in blocks of block_size (<= 0: model default); the
// last block may be short. Positions continue after the already committed ones. Returns 0 on success.
CLOVER_API int32_t clover_commit(struct llama_context * ctx, const llama_token * tokens, int32_t n_tokens, int32_t block_size);

// denoising step on sequence 0: logits of the block placed at the next position, state untouched.
// logits_out: [n_block][n_vocab] floats. Returns 0 on success, < 0 on error.
CLOVER_API int32_t clover_block_logits(struct llama_context * ctx, const llama_token * block, int32_t n_block, float * logits_out);

// The candidate choice of a denoising step as a backend sampler (a llama_sampler chain): for each
// output row, the column maximising logit/temperature + Gumbel noise (the argmax at temperature 0;
// the mask token never), and its probability, computed on the device (ggml_gumbel_argmax) so that
// only these two numbers leave it. Attach it with llama_set_sampler; a chain serves one attachment.
// The generation functions below make and attach their own unless lent one (clover_batch_set_pick).
// NULL on error.
CLOVER_API struct llama_sampler * clover_sampler_init_pick(const struct llama_model * model, float temperature);

// denoising step on sequence 0 with the candidates of smpl (clover_sampler_init_pick, attached to
// sequence 0 with llama_set_sampler): for every masked position i of the block (block[i] == the
// mask token), tok_out[i] and conf_out[i] receive its candidate and confidence, with the sampling
// noise of clover_row_key(step_key, position); other entries are left as they are. State untouched.
CLOVER_API int32_t clover_block_candidates(struct llama_context * ctx, struct llama_sampler * smpl, const llama_token * block,
                                          int32_t n_block, uint64_t step_key, llama_token * tok_out, float * conf_out);

// generate on sequence 0: clears the state, commits the prompt, then generates block by block.
// Writes at most n_out_max tokens (EOS and what follows it are dropped).
// Returns the number of tokens written, < 0 on error.
CLOVER_API int32_t clover_generate(struct llama_context * ctx, const llama_token * prompt, int32_t n_prompt,
                                  struct clover_gen_params params, llama_token * out, int32_t n_out_max,
                                  clover_block_cb cb, void * user_data);

// same, with an optional per-step callback (either callback may be NULL)
CLOVER_API int32_t clover_generate_ex(struct llama_context * ctx, const llama_token * prompt, int32_t n_prompt,
                                     struct clover_gen_params params, llama_token * out, int32_t n_out_max,
                                     clover_block_cb cb, clover_step_cb step_cb, void * user_data);

// Several sequences decoded together: every denoising step is one graph holding the current block
// of each active sequence (continuous batching at block granularity: sequences join and leave
// between steps). Each sequence gives the same tokens as it would alone.
struct clover_batch;

CLOVER_API struct clover_batch * clover_batch_init(struct llama_context * ctx);
CLOVER_API void                  clover_batch_free(struct clover_batch * batch);

// start generating on seq_id (< n_seq_max, not active): unless keep_memory, clear its memory first;
// commit the prompt after the committed history. Returns 0 on success.
CLOVER_API int32_t clover_batch_add(struct clover_batch * batch, llama_seq_id seq_id, const llama_token * prompt,
                                   int32_t n_prompt, struct clover_gen_params params, bool keep_memory);

// one denoising step for every active sequence; completed blocks are reported through cb (which
// may return false to stop that sequence) and committed unless the sequence ends there.
// Returns the number of sequences still active, < 0 on error.
CLOVER_API int32_t clover_batch_step(struct clover_batch * batch, clover_seq_block_cb cb, void * user_data);

// Constrain seq_id (active, before its first step) with a sampler, usually llama_sampler_init_grammar;
// NULL removes it. The caller owns the sampler and keeps it alive while seq_id generates.
// A constrained sequence unmasks left to right (a grammar reads text in order): each step walks
// from its leftmost masked position; at each position the sampler filters the row's logits, the
// candidate and its confidence are computed over what it allows (same noise, temperature, top-k,
// top-p), and the position is unmasked if it is the step's first, or while the schedule allows
// (threshold: confidence >= threshold; steps: the step's count); the first that is not stops the
// step. Each unmasked token is accepted into the sampler. An end-of-generation token ends the
// sequence: the positions after it become EOS. Returns 0, CLOVER_ERR_ARG if seq_id is not active.
CLOVER_API int32_t clover_batch_set_constraint(struct clover_batch * batch, llama_seq_id seq_id, struct llama_sampler * smpl);

// Make seq_id's constraint lazy (active, before its first step): it applies from the first of
// `tokens` on, the trigger tokens the sampler was made with (llama_sampler_init_grammar_lazy_patterns).
// Such a sampler filters nothing before its trigger, so until then the sequence steps as an
// unconstrained one (most confident first, the same tokens), except that the positions after the
// block's first trigger token stay masked, and are masked again if they were unmasked before it:
// once the positions before it are known they are accepted into the sampler with the trigger, and
// the rest unmasks left to right as above. n_tokens = 0: not lazy. Returns 0, CLOVER_ERR_ARG.
CLOVER_API int32_t clover_batch_set_triggers(struct clover_batch * batch, llama_seq_id seq_id, const llama_token * tokens, int32_t n_tokens);

// Report, for every generated position, the n_top most probable tokens of its row at the step that
// unmasked it (clover_block_stats.top_*; n_top in [0, CLOVER_MAX_TOP_PROBS]). The rows' logits then come to the host.
CLOVER_API int32_t clover_batch_set_top_probs(struct clover_batch * batch, llama_seq_id seq_id, int32_t n_top);

// Replace seq_id's current block (before its first step) with `block`: positions holding the mask
// token are generated, the others are kept as given (infill: known tokens inside the block). Its
// length n_block (<= min(n_ubatch, n_batch)) is the block's; the steps schedule spreads the masked
// positions. Returns 0, CLOVER_ERR_ARG or CLOVER_ERR_BLOCK.
CLOVER_API int32_t clover_batch_set_block(struct clover_batch * batch, llama_seq_id seq_id, const llama_token * block, int32_t n_block);

// Bias seq_id's logits (active, before its first step) with a sampler, usually a llama_sampler chain
// of llama_sampler_init_logit_bias and llama_sampler_init_penalties (OpenAI's logit_bias,
// frequency_penalty and presence_penalty); NULL removes it. The caller owns the sampler and keeps it
// alive while seq_id generates. It is applied to each masked row's logits (the mask token at -Inf)
// before the candidate choice and before a constraint: the candidate, its confidence (which the
// schedule compares) and the top probabilities come from the biased logits, so the sequence computes
// its candidates on the host. After each step the tokens it unmasked are accepted into the sampler in
// position order (tokens unmasked at the same step do not penalise each other; the prompt and the
// positions given by clover_batch_set_block are never accepted); when a lazy constraint masks
// positions again, the sampler is reset and the tokens still unmasked are accepted again in their
// order. Returns 0, CLOVER_ERR_ARG if seq_id is not active or has stepped.
CLOVER_API int32_t clover_batch_set_bias(struct clover_batch * batch, llama_seq_id seq_id, struct llama_sampler * smpl);

// Lend seq_id (active, before its first step) a pick sampler of the sequence's temperature that the
// caller attached to it with llama_set_sampler: the batch uses it for the sequence's device steps
// and leaves it attached and alive, so that the next generation on seq_id does not re-attach (each
// attachment re-reserves the context). Without one the batch attaches its own for the sequence's
// lifetime. Returns 0, or CLOVER_ERR_ARG if the sequence computes its candidates on the host
// (a constraint, a bias sampler, top probabilities, or top-k / top-p at a temperature > 0) or at
// another temperature.
CLOVER_API int32_t clover_batch_set_pick(struct clover_batch * batch, llama_seq_id seq_id, struct llama_sampler * smpl);

// 1 if seq_id (active) computes its candidates on the host (a constraint, a bias sampler, top
// probabilities, or top-k / top-p at a temperature > 0), so that there is no pick sampler to lend
// it; 0 if on the device; CLOVER_ERR_ARG if it is not active
CLOVER_API int32_t clover_batch_on_host(struct clover_batch * batch, llama_seq_id seq_id);

// stop seq_id now (its committed memory stays); returns 0, or -1 if it is not active
CLOVER_API int32_t clover_batch_remove(struct clover_batch * batch, llama_seq_id seq_id);

// the tokens seq_id generated so far (EOS and what follows it dropped): copies at most n_max,
// returns the count (also when out is NULL), < 0 on error
CLOVER_API int32_t clover_batch_tokens(struct clover_batch * batch, llama_seq_id seq_id, llama_token * out, int32_t n_max);

// timings since the last clover_generate / clover_perf_reset on this context; returns 0 on success.
// libclover keeps them by context address (a context has no room for a driver's figures): reset
// them after creating a context, which may reuse a freed one's address
CLOVER_API int32_t clover_get_perf(struct llama_context * ctx, struct clover_perf * perf);
CLOVER_API void    clover_perf_reset(struct llama_context * ctx);

// copy layer il's memory state of sequence 0, [H_kv][D_k][D_v] row-major (readout S^T q), into dst.
// Returns the number of floats of the state (H_kv*D*D); copies only if n_floats >= that. < 0 on error.
CLOVER_API int32_t clover_get_state(struct llama_context * ctx, int32_t il, float * dst, size_t n_floats);

// the sampling noise keys (docs/CONTRACTS.md): a step's key from the seed, the block index and the
// step index; a row's key from its step's key and its position
CLOVER_API uint64_t clover_step_key(uint64_t seed, int32_t block_index, int32_t step);
CLOVER_API uint64_t clover_row_key(uint64_t step_key, llama_pos pos);

#ifdef __cplusplus
}
#endif

#endif // CLOVER_H
