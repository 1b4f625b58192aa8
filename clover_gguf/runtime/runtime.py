"""CloverRuntime: a Clover GGUF in the patched llama.cpp (through llama-cpp-python + clover.h).

    rt = CloverRuntime("model.gguf", n_threads=8, n_gpu_layers=99, experts_on_cpu=True)
    ids = rt.tokenize(rt.chat_prompt([{"role": "user", "content": "hi"}]))
    res = rt.generate(ids, GenerationConfig(max_new_tokens=64, block_size=32))
    print(rt.detokenize(res.tokens))

`generate` is one C call per generation (the C side runs prefill, denoising and commits; block
statistics come back through a callback). `RuntimeBackend(rt)` is a `LogitsBackend` so that
`clover_gguf.reference.generate.generate` can drive the runtime step by step (parity with the PyTorch
reference).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..constants import DEFAULT_THRESHOLD
from ..gguf_io.reader import GGUFReadError, check_structure
from ..inputs import InputError, regular_file
from ..options import GGML_MAX_N_THREADS, RANGES
from ..plan.vram import runtime_n_ubatch
from ..reference.generate import BlockStats, GenerationConfig, GenerationResult, NonFiniteError
from ..util import default_threads
from . import bindings as B
from .bindings import RuntimeNotBuilt  # noqa: F401  (re-exported)
from .vocab import GrammarError, RuntimeError_, RuntimeLoadError, Vocab  # noqa: F401  (re-exported)


class CloverRuntime(Vocab):
    """One model + one context with n_seq_max sequences (calls without `seq` use sequence 0).
    Not thread-safe."""

    def __init__(
        self,
        gguf_path: str | Path,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        experts_on_cpu: bool = False,
        n_ctx: int = 0,
        cpu_tensors=(),
        n_batch: int | None = None,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        quiet: bool = True,
        rpc_servers: str | list[str] | None = None,
        op_offload: bool = True,
        mmap: bool = True,
    ):
        self.path = Path(gguf_path)
        if n_threads is not None:  # ggml's thread-pool limit (options.py): more crashed the first decode
            RANGES["threads"].check(n_threads, "n_threads")
        try:
            regular_file(self.path)  # llama.cpp would block on a FIFO
        except InputError as e:
            raise RuntimeLoadError(str(e).replace("no such file", "no such GGUF file")) from None
        self._lib = B.load()
        self._log = B.log_capture(self._lib, verbose=not quiet)
        self._keep: list = []
        self.rpc_servers = B.parse_rpc_servers(rpc_servers)
        self.model = self._load_model(n_gpu_layers, experts_on_cpu, cpu_tensors, mmap)
        # tensor -> buffer type of every tensor a buffer-type override placed (experts_on_cpu),
        # as llama.cpp's loader reports it
        self.buffer_overrides = dict(self._log.overrides)
        self._read_vocab()
        self.n_threads = int(n_threads or min(default_threads(), GGML_MAX_N_THREADS))
        self.n_seq_max = int(n_seq_max)
        self.ctx = self._new_context(n_ctx, n_batch, n_ubatch, op_offload)
        # where the layers, weights, memory and compute buffers went (llama.cpp's load log: it
        # has no API for it), e.g. {"layers": {"RPC0": [0, 1]}, "buffers": {"model": {...}}, ...}
        self.placement = B.parse_placement(self._log.placement, self.n_layer)
        self._logits = np.empty((0,), dtype=np.float32)
        self._state_sizes: dict[int, int] = {}
        self._nonfinite_diag: str | None = None
        self.last_perf: dict | None = None
        # seq -> (temperature, sampler): the pick samplers attached to sequences; they stay
        # attached across generations because each attachment re-reserves the context
        self._picks: dict[int, tuple[float, int]] = {}

    def _load_model(self, n_gpu_layers: int, experts_on_cpu: bool, cpu_tensors, mmap: bool):
        """llama_model_load_from_file with the placement asked for; RuntimeLoadError says why not."""
        try:
            devices = B.offload_devices(self._lib, self.rpc_servers)
        except B.RpcError as e:
            raise RuntimeLoadError(str(e)) from None
        mp = B.model_params(self._lib, n_gpu_layers, experts_on_cpu, self._keep, cpu_tensors, devices, mmap)
        self._log.mark()
        self._log.overrides.clear()
        self._log.placement.clear()
        with B.stderr_silenced(not self._log.verbose):
            model = self._lib.lc.llama_model_load_from_file(str(self.path).encode(), mp)
        if not model:
            raise RuntimeLoadError(_load_failure(self.path, self._log.reason() or "llama.cpp could not load it"))
        try:  # what llama.cpp accepts but must not: a last tensor whose type is smaller than its data
            check_structure(self.path)
        except GGUFReadError as e:
            self._lib.lc.llama_model_free(model)
            raise RuntimeLoadError(str(e)) from None
        return model

    def _new_context(self, n_ctx: int, n_batch: int | None, n_ubatch: int | None, op_offload: bool):
        """llama_init_from_model; on failure the model is freed and RuntimeLoadError says why."""
        lc = self._lib.lc
        # clover.h: n_ubatch >= B (a multiple of B folds several prompt blocks per graph, and
        # n_seq_max * B lets one denoising graph hold every sequence), n_batch >= n_ubatch,
        # n_ctx >= n_ubatch.
        ub = int(n_ubatch or runtime_n_ubatch(self.n_seq_max, self.default_block_size))
        nb = int(n_batch or ub)
        n_ctx = max(int(n_ctx or self.n_ctx_train), ub)
        self.n_ubatch, self.n_batch = ub, nb
        cp = B.context_params(
            self._lib,
            n_ctx=n_ctx,
            n_batch=nb,
            n_ubatch=ub,
            n_threads=self.n_threads,
            n_seq_max=self.n_seq_max,
            op_offload=op_offload,
        )
        self._log.mark()
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            lc.llama_model_free(self.model)
            self.model = None
            why = self._log.reason() or "no reason logged"
            raise RuntimeLoadError(_load_failure(self.path, f"cannot create a context ({why})", why))
        self._lib.clover_perf_reset(ctx)  # libclover keys its figures by address: not a freed context's
        return ctx

    # ---------------------------------------------------------------- lifetime
    def close(self):
        lc = getattr(self, "_lib", None) and self._lib.lc
        if lc is None:
            return
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        for _, smpl in getattr(self, "_picks", {}).values():
            self._lib.llama_sampler_free(smpl)
        self._picks = {}
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- metadata
    # ---------------------------------------------------------------- memory / blocks
    def diagnose_nonfinite(self, commits: list[tuple[list[int], int]], block: list[int]) -> str:
        """The first tensor whose output is not finite, by a debug pass (runtime/nonfinite.py) on a
        second context: the commits replayed, then one denoising step of ``block``. Found once
        per runtime (the cause is the weights; a server must not pay for it on every request)."""
        if self._nonfinite_diag is None:
            from .nonfinite import explain, first_nonfinite

            self._nonfinite_diag = explain(*first_nonfinite(self, commits, block))
        return self._nonfinite_diag

    def _nonfinite(self, batch, seqs: dict) -> NonFiniteError:
        """clover_batch_step's CLOVER_ERR_NONFINITE as one line: the C side's where, the debug
        pass's why."""
        why = self._log.reason() or "non-finite logits in a denoising step"
        m = re.search(r"sequence (\d+)", why)
        q = seqs.get(int(m.group(1))) if m else None
        diag = ""
        if q is not None:
            seq = int(m.group(1))
            k = max(0, self._lib.clover_batch_tokens(batch, seq, None, 0))
            gen = (B.llama_token * max(1, k))()
            self._lib.clover_batch_tokens(batch, seq, gen, k)
            L = max(1, min(q["bs"], q["n_max"] - k))
            diag = self.diagnose_nonfinite([(q["prompt"], q["bs"]), (list(gen[:k]), q["bs"])], [self.mask_token_id] * L)
        return NonFiniteError(f"{self.path}: {why}{diag}")

    def reset(self, seq: int | None = None) -> None:
        """Clear the memory: all of it, or only sequence `seq`'s."""
        if seq is None:
            self._check(self._lib.clover_reset(self.ctx), "clover_reset")
        else:
            lc = self._lib.lc
            lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), self._seq(seq), -1, -1)

    def _seq(self, seq: int) -> int:
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"sequence {seq} outside [0, n_seq_max = {self.n_seq_max})")
        return seq

    @property
    def n_committed(self) -> int:
        return self._check(self._lib.clover_n_committed(self.ctx), "clover_n_committed")

    def commit(self, tokens, block_size: int | None = None, seq: int = 0) -> None:
        """Fold tokens into the memory of sequence `seq` in blocks of block_size (the last may be short)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        bs = int(block_size or self.default_block_size)
        if bs > self.n_ubatch:
            raise ValueError(f"block_size {bs} > n_ubatch {self.n_ubatch}: create the runtime with n_ubatch >= {bs}")
        if seq == 0:
            self._check(self._lib.clover_commit(self.ctx, B.token_ptr(tokens), len(tokens), bs), "clover_commit")
            return
        # clover.h commits on other sequences through a batch: adding a sequence commits its
        # prompt after the kept memory (the same commit_seq as clover_commit), removing it
        # before any step generates nothing
        lib = self._lib
        batch = lib.clover_batch_init(self.ctx)
        if not batch:
            raise RuntimeError_("clover_batch_init failed")
        try:
            p = self.gen_params(GenerationConfig(block_size=bs, max_new_tokens=1))
            self._check(
                lib.clover_batch_add(batch, self._seq(seq), B.token_ptr(tokens), len(tokens), p, True),
                "clover_batch_add",
            )
            lib.clover_batch_remove(batch, seq)
        finally:
            lib.clover_batch_free(batch)

    def block_logits_np(self, block) -> np.ndarray:
        """Logits [L, V] float32 of the block at the next position; the memory is untouched."""
        block = [int(t) for t in block]
        L = len(block)
        if L > self.n_ubatch:
            raise ValueError(f"block of {L} > n_ubatch {self.n_ubatch}")
        out = np.empty((L, self.n_vocab), dtype=np.float32)
        ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self._drop_pick(0)  # the rows' logits come to the host
        self._check(self._lib.clover_block_logits(self.ctx, B.token_ptr(block), L, ptr), "clover_block_logits")
        return out

    def block_logits(self, block) -> torch.Tensor:
        return torch.from_numpy(self.block_logits_np(block))

    def state(self, layer: int) -> np.ndarray:
        """Layer `layer`'s memory, [H_kv, D_k, D_v] float32 (readout S^T q), a copy."""
        f = self._lib.clover_get_state
        n = self._state_sizes.get(layer)
        if n is None:
            n = self._check(f(self.ctx, layer, None, 0), f"clover_get_state({layer})")
            self._state_sizes[layer] = n
        out = np.empty((n,), dtype=np.float32)
        self._check(
            f(self.ctx, layer, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n), f"clover_get_state({layer})"
        )
        hkv = max(1, int(self._lib.lc.llama_model_n_head_kv(self.model)))
        D = int(round((n // hkv) ** 0.5))
        if D * D * hkv != n:
            raise RuntimeError_(f"state of {n} floats is not H_kv={hkv} x D x D")
        return out.reshape(hkv, D, D)

    def states(self) -> list[np.ndarray]:
        return [self.state(i) for i in range(self.n_layer)]

    def save_state(self, seq: int = 0) -> bytes:
        """The whole memory of sequence `seq` (states and committed position), for load_state."""
        lc = self._lib.lc
        n = int(lc.llama_state_seq_get_size(self.ctx, self._seq(seq)))
        buf = (ctypes.c_uint8 * n)()
        if int(lc.llama_state_seq_get_data(self.ctx, buf, n, seq)) != n:
            raise RuntimeError_("llama_state_seq_get_data failed")
        return bytes(buf)

    def load_state(self, blob: bytes, seq: int = 0) -> None:
        """Replace the memory of sequence `seq` by a save_state snapshot of any sequence (bit-exact)."""
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if int(self._lib.lc.llama_state_seq_set_data(self.ctx, buf, len(blob), self._seq(seq))) != len(blob):
            raise RuntimeError_("llama_state_seq_set_data failed: a snapshot of another model or context?")

    # ---------------------------------------------------------------- generation
    def bias_sampler(self, cfg: GenerationConfig) -> int:
        """llama.cpp's logit_bias then penalties samplers (repeat penalty off, the window
        cfg.penalty_last_n()) in a chain, for clover_batch_set_bias; the caller frees it
        (llama_sampler_free)."""
        lc = self._lib.lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if not chain:
            raise RuntimeError_("llama_sampler_chain_init failed")
        bias = cfg.active_logit_bias()
        if bias:
            arr = (lc.llama_logit_bias * len(bias))(*[lc.llama_logit_bias(t, b) for t, b in bias.items()])
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(self.n_vocab, len(bias), arr))
        if cfg.presence_penalty or cfg.frequency_penalty:
            pen = lc.llama_sampler_init_penalties(
                self.n_vocab, cfg.penalty_last_n(), 1.0, float(cfg.frequency_penalty), float(cfg.presence_penalty)
            )
            lc.llama_sampler_chain_add(chain, pen)
        return chain

    def gen_params(self, cfg: GenerationConfig) -> B.clover_gen_params:
        p = self._lib.clover_gen_default_params()
        p.block_size = int(cfg.block_size)
        p.steps = int(cfg.steps) if cfg.steps is not None else 0
        p.threshold = float(cfg.threshold if cfg.threshold is not None else DEFAULT_THRESHOLD)
        p.temperature = float(cfg.temperature)
        p.top_k = int(cfg.top_k)
        p.top_p = float(cfg.top_p)
        p.seed = int(cfg.seed) & 0xFFFFFFFF
        p.max_new_tokens = int(cfg.max_new_tokens)
        return p

    def generate(
        self,
        prompt_ids,
        cfg: GenerationConfig | None = None,
        on_block: Callable[[list[int], BlockStats], bool | None] | None = None,
        reset: bool = True,
    ) -> GenerationResult:
        """Prefill, then blocks until max_new_tokens or EOS, natively (clover.h's batch API on
        sequence 0). The mask and EOS tokens are the GGUF's (cfg.mask_token_id/eos_token_id are
        not used). on_block(tokens, stats) runs after each block; returning False stops.
        reset=False continues from the committed memory: the prompt is committed after it."""
        cb = None if on_block is None else (lambda _i, toks, st: on_block(toks, st))
        return self.generate_batch([prompt_ids], [cfg], cb, reset=reset)[0]

    def generate_batch(
        self,
        prompts: list,
        cfgs: list[GenerationConfig | None],
        on_block: Callable[[int, list[int], BlockStats], bool | None] | None = None,
        reset: bool = True,
        on_finish: Callable[[int, GenerationResult], None] | None = None,
        refill: Callable[[list[int]], list[tuple[int, list, GenerationConfig]]] | None = None,
        after_step: Callable[[int], bool] | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts at once: sequence i holds prompts[i], and every denoising
        step is one graph with the current block of each unfinished sequence (needs n_seq_max >=
        len(prompts)). Each sequence gives the tokens it gives alone. on_block(i, tokens, stats).
        on_finish(i, result) runs as soon as sequence i has ended (after the step that ended it,
        outside the C call: it may use this runtime's other sequences, e.g. commit or save_state).
        refill(free sequence ids) runs between steps and returns (seq, prompt, cfg) to start
        there (continuous batching: they join the next step; their prompt is committed after
        the sequence's memory, as with reset=False); results of those come only to on_finish.
        after_step(i) runs after each denoising step for each sequence that took part; False
        stops that sequence at once, mid-block (clover_batch_remove: its memory keeps what was
        committed; on_finish gets the tokens of its finished blocks): cancellation per step.
        Returns the results of `prompts`."""
        n = len(prompts)
        if n > self.n_seq_max:
            raise ValueError(f"{n} sequences > n_seq_max {self.n_seq_max}: create the runtime with n_seq_max >= {n}")
        cfgs = [c or GenerationConfig(block_size=self.default_block_size) for c in cfgs]
        run = _BatchRun(self, on_block)
        ended = run.ended  # sequences the last step ended
        first: dict[int, GenerationResult] = {}  # results of `prompts`
        try:
            if reset:
                self.reset()
            self._lib.clover_perf_reset(self.ctx)
            for i, (p, c) in enumerate(zip(prompts, cfgs)):
                run.add(i, p, c, not reset)
            active = set(range(n))
            while True:
                n_c = run.step(active, after_step) if len(ended) < len(active) else 0
                if n_c == 0:  # a sequence the mirror missed still ends here
                    ended.extend(i for i in active if i not in ended)
                for i in dict.fromkeys(ended):
                    res = run.result(i)
                    active.discard(i)
                    if i < n and i not in first:
                        first[i] = res
                    if on_finish is not None:
                        on_finish(i, res)
                ended.clear()
                if refill is not None:
                    run.refill(refill, active)
                if not active:
                    break
        finally:
            run.close()
        self.last_perf = self.perf()
        return [first[i] for i in range(n)]

    def _drop_pick(self, seq: int) -> None:
        """Detach sequence seq's pick sampler (a sequence with a backend sampler gets no logits)."""
        if seq in self._picks:
            self._lib.llama_set_sampler(self.ctx, seq, None)
            self._lib.llama_sampler_free(self._picks.pop(seq)[1])

    def _pick(self, seq: int, temperature: float) -> int:
        """Sequence seq's pick sampler (clover_sampler_init_pick) at this temperature, attached."""
        temperature = max(0.0, float(temperature))
        if seq in self._picks and self._picks[seq][0] == temperature:
            return self._picks[seq][1]
        self._drop_pick(seq)
        smpl = self._lib.clover_sampler_init_pick(self.model, temperature)
        if not smpl:
            raise RuntimeError_(f"clover_sampler_init_pick({temperature}) failed")
        if not self._lib.llama_set_sampler(self.ctx, seq, smpl):
            self._lib.llama_sampler_free(smpl)
            raise RuntimeError_("llama_set_sampler: this backend cannot run the pick sampler")
        self._picks[seq] = (temperature, smpl)
        return smpl

    def block_candidates(self, block, temperature: float, step_key: int) -> tuple[np.ndarray, np.ndarray]:
        """The device path of a denoising step: (candidate, confidence) of every masked
        position of the block (other positions: -1 and nan), computed in the graph by the pick
        sampler (clover_sampler_init_pick) attached to sequence 0."""
        block = [int(t) for t in block]
        L = len(block)
        tok = np.full(L, -1, dtype=np.int32)
        conf = np.full(L, np.nan, dtype=np.float32)
        smpl = self._pick(0, temperature)
        self._check(
            self._lib.clover_block_candidates(
                self.ctx,
                smpl,
                B.token_ptr(block),
                L,
                int(step_key),
                tok.ctypes.data_as(ctypes.POINTER(B.llama_token)),
                conf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            ),
            "clover_block_candidates",
        )
        return tok, conf

    def perf(self) -> dict:
        """clover_get_perf: timings since the last generate (prefill, steps and their breakdown)."""
        p = B.clover_perf()
        self._check(self._lib.clover_get_perf(self.ctx, ctypes.byref(p)), "clover_get_perf")
        return {k: getattr(p, k) for k, _ in B.clover_perf._fields_}


class _BatchRun:
    """One clover_batch of CloverRuntime.generate_batch: adds sequences, steps them, and keeps
    what each sequence needs for its result (its block statistics, tokens generated, limit,
    prompt and its length, start time, prefill ms, grammar and bias samplers)."""

    def __init__(self, rt: CloverRuntime, on_block: Callable[[int, list[int], BlockStats], bool | None] | None):
        self.rt, self.lib = rt, rt._lib
        self.on_block = on_block
        self.seqs: dict[int, dict] = {}
        self.err: list[BaseException] = []  # raised in the callback, re-raised after the step
        self.ended: list[int] = []  # sequences the last step ended
        self.c_cb = B.clover_seq_block_cb(self._block_done)
        self.batch = self.lib.clover_batch_init(rt.ctx)
        if not self.batch:
            raise RuntimeError_("clover_batch_init failed")

    def _block_done(self, seq_id, stats_p, _user):
        """clover_batch_step's callback after each block of a sequence; True goes on."""
        try:
            s = stats_p.contents
            st = _block_stats(s)
            q = self.seqs[seq_id]
            q["blocks"].append(st)
            toks = [int(s.tokens[i]) for i in range(s.n_tokens)]
            go_on = True if self.on_block is None else self.on_block(seq_id, toks, st) is not False
            q["n_gen"] += s.n_tokens
            # the C side ends a sequence after a block with EOS (a constrained one: any
            # end-of-generation token), a callback that returns False, or max_new_tokens
            # generated; mirrored here to report it at once
            ends = self.rt.eog if q["grammar"] else {self.rt.eos_token_id}
            if not go_on or not ends.isdisjoint(toks) or q["n_gen"] >= q["n_max"]:
                self.ended.append(seq_id)
            return go_on
        except BaseException as e:  # never let an exception cross the C frame
            self.err.append(e)
            return False

    def add(self, seq: int, prompt, c: GenerationConfig, keep: bool) -> None:
        """Start sequence `seq` (its prompt committed after its kept memory when `keep`)."""
        rt, lib, batch = self.rt, self.lib, self.batch
        c.validate(rt.n_vocab)
        if c.block_size > rt.n_ubatch:
            raise ValueError(f"block_size {c.block_size} > n_ubatch {rt.n_ubatch}")
        grammar = rt.grammar_sampler(c.grammar, c.grammar_triggers) if c.grammar is not None else None
        bias = None
        toks = [int(t) for t in prompt]
        tp = time.perf_counter()
        try:
            bias = rt.bias_sampler(c) if c.biases() else None  # off: no sampler, the paths as without
            rt._check(
                lib.clover_batch_add(batch, rt._seq(seq), B.token_ptr(toks), len(toks), rt.gen_params(c), keep),
                "clover_batch_add",
            )
        except BaseException:
            for smpl in (grammar, bias):
                if smpl:
                    lib.lc.llama_sampler_free(smpl)
            raise
        q = self.seqs[seq] = dict(
            blocks=[], n_gen=0, n_max=c.max_new_tokens, n_prompt=len(toks), t0=tp, grammar=grammar, bias=bias
        )
        q.update(prompt=toks, bs=c.block_size)
        q["prefill_ms"] = (time.perf_counter() - tp) * 1e3
        if c.max_new_tokens == 0:  # as the reference: no block (clover.h's 0 means no limit)
            lib.clover_batch_remove(batch, seq)
            self.ended.append(seq)
            return
        if grammar:
            rt._check(lib.clover_batch_set_constraint(batch, seq, grammar), "clover_batch_set_constraint")
            if c.grammar_triggers:  # unconstrained steps until a trigger token (clover.h)
                trig = [int(t) for t in c.grammar_triggers]
                rt._check(
                    lib.clover_batch_set_triggers(batch, seq, B.token_ptr(trig), len(trig)), "clover_batch_set_triggers"
                )
        if bias:  # logit bias and penalties on the host, before the constraint (clover.h)
            rt._check(lib.clover_batch_set_bias(batch, seq, bias), "clover_batch_set_bias")
        if c.n_probs:
            rt._check(lib.clover_batch_set_top_probs(batch, seq, c.n_probs), "clover_batch_set_top_probs")
        if c.first_block is not None:
            fb = [int(t) for t in c.first_block]
            if fb:
                rt._check(lib.clover_batch_set_block(batch, seq, B.token_ptr(fb), len(fb)), "clover_batch_set_block")
            q["n_max"] = max(c.max_new_tokens, len(fb))
        # the driver's rule: a sequence on the host path has no pick sampler
        if rt._check(lib.clover_batch_on_host(batch, seq), "clover_batch_on_host"):
            rt._drop_pick(seq)
        else:
            smpl = rt._pick(seq, c.temperature)
            rt._check(lib.clover_batch_set_pick(batch, seq, smpl), "clover_batch_set_pick")

    def step(self, active: set[int], after_step: Callable[[int], bool] | None) -> int:
        """One denoising step of every unfinished sequence; returns the number of blocks
        committed (0: none left)."""
        lib, ended = self.lib, self.ended
        stepped = sorted(set(active) - set(ended))
        rc = lib.clover_batch_step(self.batch, self.c_cb, None)
        if self.err:
            raise self.err[0]
        if rc == B.CLOVER_ERR_NONFINITE:  # never tokens from NaN/Inf logits
            raise self.rt._nonfinite(self.batch, self.seqs)
        n_c = self.rt._check(rc, "clover_batch_step")
        for i in stepped if after_step is not None else ():
            if not after_step(i) and i not in ended:
                lib.clover_batch_remove(self.batch, i)  # -1 only if it had ended already
                ended.append(i)
        return n_c

    def result(self, i: int) -> GenerationResult:
        """Sequence i's result (it has ended); frees its grammar and bias samplers."""
        lib, q = self.lib, self.seqs[i]
        self._free_samplers(q)
        k = self.rt._check(lib.clover_batch_tokens(self.batch, i, None, 0), "clover_batch_tokens")
        out = (B.llama_token * max(1, k))()
        lib.clover_batch_tokens(self.batch, i, out, k)
        total = (time.perf_counter() - q["t0"]) * 1e3
        return GenerationResult(list(out[:k]), q["blocks"], q["n_prompt"], q["prefill_ms"], total)

    def refill(self, refill: Callable[[list[int]], list[tuple[int, list, GenerationConfig]]], active: set[int]) -> None:
        """Start what refill(free sequence ids) returns on those sequences."""
        free = [i for i in range(self.rt.n_seq_max) if i not in active]
        for seq, p, c in refill(free) if free else []:
            if seq not in free:
                raise ValueError(f"refill: sequence {seq} is not free")
            self.add(seq, p, c, True)
            active.add(seq)
            free.remove(seq)

    def close(self) -> None:
        self.lib.clover_batch_free(self.batch)
        self.c_cb = None  # it holds this object: no reference cycle once the batch is gone
        for q in self.seqs.values():
            self._free_samplers(q)

    def _free_samplers(self, q: dict) -> None:
        for k in ("grammar", "bias"):
            smpl, q[k] = q[k], None
            if smpl:
                self.lib.lc.llama_sampler_free(smpl)


def _block_stats(s) -> BlockStats:
    """A clover_block_stats (C) as BlockStats."""
    k, L, m = s.n_steps, s.n_tokens, s.n_top
    return BlockStats(
        index=s.block_index,
        n_tokens=L,
        steps=k,
        tokens_per_step=[int(s.tokens_per_step[i]) for i in range(k)],
        ms_per_step=[float(s.ms_per_step[i]) for i in range(k)],
        probs=[float(s.probs[i]) for i in range(L)],
        top=[
            [(int(s.top_tokens[i * m + j]), float(s.top_probs[i * m + j])) for j in range(m)]
            for i in range(L if m else 0)
        ],
    )


class RuntimeBackend:
    """CloverRuntime as a clover_gguf.reference.generate.LogitsBackend (step-by-step driving from Python)."""

    def __init__(self, rt: CloverRuntime, reset: bool = True):
        self.rt = rt
        self.n_vocab = rt.n_vocab
        self.commits: list[tuple[list[int], int]] = []  # since the reset, for diagnose()
        if reset:
            rt.reset()

    def prefill(self, tokens, block_size):
        self.rt.commit(tokens, block_size)
        self.commits.append((list(tokens), block_size))

    def block_logits(self, block):
        return self.rt.block_logits(block)

    def commit(self, block):
        self.rt.commit(block, len(block))
        self.commits.append((list(block), len(block)))

    def diagnose(self, block) -> str:
        return self.rt.diagnose_nonfinite(self.commits, list(block))


# what llama.cpp reports (strerror, or a failed allocation) when the machine, not the file, ran
# out: memory, address space (ulimit -v), threads, open files
_RESOURCE_ERRORS = {os.strerror(e) for e in (errno.ENOMEM, errno.EAGAIN, errno.EMFILE, errno.ENFILE)}
_RESOURCE_WORDS = ("bad_alloc", "failed to allocate", "out of memory", "cannot allocate memory")


def _load_failure(path: Path, what: str, why: str | None = None) -> str:
    """A load or context failure as one line; one caused by a system limit does not blame the file."""
    why = why if why is not None else what
    if why.strip() in _RESOURCE_ERRORS or any(w in why.lower() for w in _RESOURCE_WORDS):
        return (
            f"{path}: llama.cpp ran out of memory or another system resource while loading it ({why}); "
            "the file is not at fault: free memory or raise the limits (ulimit -v, -u, -n)"
        )
    return f"{path}: {what}"


def _ranges(ids: list[int]) -> str:
    ids, parts = sorted(ids), []
    for i in ids:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def placement_line(p: dict) -> str:
    """CloverRuntime.placement in one line: the layers of each device, the MiB of weights and
    memory of each buffer."""
    layers = "; ".join(f"layers {_ranges(v)} on {k}" for k, v in p.get("layers", {}).items())
    bufs = p.get("buffers", {})
    mib = lambda d: ", ".join(f"{k} {v:.1f} MiB" for k, v in d.items())
    parts = [layers or "layers: not logged"]
    if p.get("output"):
        parts.append(f"output layer on {p['output']}")
    if p.get("offloaded_layers"):
        parts.append(f"offloaded {p['offloaded_layers']}")
    if bufs.get("model"):
        parts.append("weights: " + mib(bufs["model"]))
    if bufs.get("memory"):
        parts.append("memory: " + mib(bufs["memory"]))
    return "; ".join(parts)
