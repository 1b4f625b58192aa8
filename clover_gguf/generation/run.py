"""`clover-gguf run`: generate from a safetensors model folder (PyTorch reference) or a
`.gguf` file (patched llama.cpp runtime), with the same options and output."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..plan.vram import runtime_n_ubatch
from ..reference.generate import GenerationResult
from ..util import DEFAULT_MODEL
from .loader import load


@dataclass
class RunOutput:
    completion: str | None
    prompt_ids: list[int]
    result: GenerationResult
    backend: str
    placement: dict | None = None  # the runtime's (layers and buffers per device), with --rpc

    def to_dict(self) -> dict:
        r = self.result
        gen_s = sum(sum(b.ms_per_step) for b in r.blocks) / 1e3
        return {
            "backend": self.backend,
            **({"placement": self.placement} if self.placement else {}),
            "completion": self.completion,
            "prompt_ids": self.prompt_ids,
            "token_ids": r.tokens,
            "blocks": [b.__dict__ for b in r.blocks],
            "prefill_ms": r.prefill_ms,
            "total_ms": r.total_ms,
            "prompt_tokens_per_s": (len(self.prompt_ids) / (r.prefill_ms / 1e3)) if r.prefill_ms > 0 else None,
            "gen_tokens_per_s": (sum(b.n_tokens for b in r.blocks) / gen_s) if gen_s > 0 else None,
        }


def check_request(
    prompt: str | None, ids: list[int] | None, n_vocab: int, n_ctx: int, max_new: int, block: int
) -> None:
    """The prompt is text (UTF-8) or ids of the vocabulary, and it and the new tokens, in
    whole blocks, fit the model's context length."""
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"-p: the prompt is not valid UTF-8 (byte {e.start})") from None
    if ids is not None:
        bad = [i for i in ids if not 0 <= i < n_vocab]
        if bad:
            raise ValueError(f"--prompt-ids: token {bad[0]} is not an id in [0, {n_vocab - 1}]")
        need = len(ids) + -(-max_new // block) * block
        if need > n_ctx:
            raise ValueError(
                f"-n {max_new}: the prompt ({len(ids)} tokens) and {max_new} new tokens in blocks of {block} need "
                f"{need} positions, more than the model's context length ({n_ctx})"
            )


def check_prompt_tokens(ids: list[int]) -> None:
    """A text prompt gives at least one token (llama-clover-cli's rule and words, native/clover-cli.cpp):
    a GGUF whose token strings match nothing (not UTF-8, say) must not generate from nothing."""
    if not ids:
        raise ValueError("-p: the prompt gives no tokens")


def _messages(prompt: str, system: str | None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": prompt}]


def run(
    model: str | Path = DEFAULT_MODEL,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    block_size: int | None = None,
    steps: int | None = None,
    threshold: float | None = None,
    temp: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    chat: bool = False,
    think: bool = True,
    system: str | None = None,
    threads: int | None = None,
    n_gpu_layers: int = 0,
    experts_on_cpu: bool = False,
    override_tensor=(),
    dtype: str = "float32",
    on_block=None,
    rpc: str | None = None,
    fit: bool | None = None,
    log=None,
    op_offload: bool = True,
    mmap: bool = True,
) -> RunOutput:
    """Generate a completion. `model` is a safetensors model folder or a .gguf file (loader.load).
    `rpc`: llama.cpp RPC servers 'HOST:PORT[,...]' that -ngl layers are offloaded to (.gguf only).
    op_offload/mmap: llama.cpp's --no-op-offload / --no-mmap (.gguf only; docs/plan.md)."""
    model = Path(model)
    if prompt is None and prompt_ids is None:
        raise ValueError("give a prompt or prompt ids")
    if rpc is not None and model.suffix != ".gguf":
        raise ValueError("--rpc needs a .gguf model (llama.cpp's RPC backend)")
    runtime = {}
    if model.suffix == ".gguf":
        # a --block-size past the default batch (256) needs a batch that holds it
        n_ubatch = runtime_n_ubatch(1, block_size) if block_size else None
        runtime = dict(n_gpu_layers=n_gpu_layers, experts_on_cpu=experts_on_cpu, override_tensor=override_tensor)
        runtime.update(fit=fit, rpc=rpc, log=log, op_offload=op_offload, mmap=mmap, n_ubatch=n_ubatch)
    gen = load(model, threads=threads, dtype=dtype, **runtime)
    B = block_size or gen.block_size
    check_request(prompt, None, gen.n_vocab, gen.n_ctx, max_new_tokens, B)
    if prompt_ids is not None:
        ids = list(prompt_ids)
    else:
        text = gen.chat_prompt(_messages(prompt, system), enable_thinking=think) if chat else prompt
        ids = gen.tokenize(text, add_special=True)  # BOS/EOS as the model's tokenizer says
        check_prompt_tokens(ids)
    check_request(None, ids, gen.n_vocab, gen.n_ctx, max_new_tokens, B)
    sampling = dict(steps=steps, threshold=threshold, temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
    cfg = gen.config(max_new_tokens=max_new_tokens, block_size=B, **sampling)
    res = gen.generate(ids, cfg, on_block=on_block)
    completion = gen.detokenize(res.tokens) if prompt_ids is None else None
    return RunOutput(completion, ids, res, gen.backend, gen.placement)


def print_output(out: RunOutput, as_json: bool) -> None:
    d = out.to_dict()
    if as_json:
        json.dump(d, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    print(out.completion if out.completion is not None else " ".join(map(str, d["token_ids"])))
    if out.placement:
        from ..runtime.runtime import placement_line

        print(f"\n[rpc] {placement_line(out.placement)}", file=sys.stderr)
    steps = [b["steps"] for b in d["blocks"]]
    print(
        f"\n[{d['backend']}] prompt {len(out.prompt_ids)} tok, generated {len(d['token_ids'])} tok "
        f"in {len(steps)} blocks, {sum(steps)} steps; "
        f"prefill {d['prompt_tokens_per_s'] or 0:.1f} tok/s, generation {d['gen_tokens_per_s'] or 0:.1f} tok/s",
        file=sys.stderr,
    )
