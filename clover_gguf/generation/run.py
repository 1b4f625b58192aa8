"""`clover-gguf run`: generate from a safetensors model folder (PyTorch reference) or a
`.gguf` file (patched llama.cpp runtime), with the same options and output."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..reference.generate import GenerationConfig, GenerationResult, NonFiniteError, TorchBackend, generate
from ..util import DEFAULT_MODEL


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
    """Generate a completion. `model` is a safetensors model folder or a .gguf file. `rpc`:
    llama.cpp RPC servers 'HOST:PORT[,...]' that -ngl layers are offloaded to (.gguf only).
    op_offload/mmap: llama.cpp's --no-op-offload / --no-mmap (.gguf only; docs/plan.md)."""
    model = Path(model)
    if prompt is None and prompt_ids is None:
        raise ValueError("give a prompt or prompt ids")
    sampling = dict(
        max_new_tokens=max_new_tokens,
        steps=steps,
        threshold=threshold,
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    if rpc is not None and model.suffix != ".gguf":
        raise ValueError("--rpc needs a .gguf model (llama.cpp's RPC backend)")
    if model.suffix == ".gguf":
        from ..plan.placement import fit_overrides
        from ..plan.vram import runtime_n_ubatch
        from ..runtime.bindings import parse_override
        from ..runtime.runtime import CloverRuntime

        cpu_tensors = [parse_override(s) for s in override_tensor]
        # --fit: the leading layers' experts that must stay in CPU memory for the rest to fit
        explicit = bool(override_tensor) or experts_on_cpu
        log = log or (lambda m: print(m, file=sys.stderr))
        ot = fit_overrides(model, n_gpu_layers, fit, explicit, log=log, rpc=bool(rpc), op_offload=op_offload)
        cpu_tensors += [parse_override(s) for s in ot]
        rt = CloverRuntime(
            model,
            n_threads=threads,
            n_gpu_layers=n_gpu_layers,
            experts_on_cpu=experts_on_cpu,
            cpu_tensors=cpu_tensors,
            rpc_servers=rpc,
            op_offload=op_offload,
            mmap=mmap,
            # a --block-size past the default batch (256) needs a batch that holds it
            n_ubatch=runtime_n_ubatch(1, block_size) if block_size else None,
        )
        check_request(prompt, None, rt.n_vocab, rt.n_ctx_train, max_new_tokens, block_size or rt.default_block_size)
        text = rt.chat_prompt(_messages(prompt, system), enable_thinking=think) if chat and prompt else prompt
        # add_special: BOS/EOS as the GGUF's add_bos_token/add_eos_token say (llama-clover-cli's rule)
        ids = list(prompt_ids) if prompt_ids is not None else rt.tokenize(text, add_special=True)
        check_request(None, ids, rt.n_vocab, rt.n_ctx_train, max_new_tokens, block_size or rt.default_block_size)
        cfg = GenerationConfig(
            block_size=block_size or rt.default_block_size,
            mask_token_id=rt.mask_token_id,
            eos_token_id=rt.eos_token_id,
            **sampling,
        )
        res = rt.generate(ids, cfg, on_block=on_block)
        completion = rt.detokenize(res.tokens) if prompt_ids is None else None
        return RunOutput(completion, ids, res, "llama.cpp", rt.placement if rt.rpc_servers else None)

    from ..reference.model import CloverModel

    if threads:
        torch.set_num_threads(threads)
    m = CloverModel.from_pretrained(model, dtype=getattr(torch, dtype))
    tok = None
    if (model / "tokenizer.json").exists():
        from ..tokenizer import CloverTokenizer

        tok = CloverTokenizer.from_dir(model)
    c = m.config
    n_ctx = _context_length(model)
    check_request(prompt, None, c.vocab_size, n_ctx, max_new_tokens, block_size or c.block_size)
    if prompt_ids is not None:
        ids = list(prompt_ids)
    elif tok is None:
        raise ValueError(f"{model}: no tokenizer.json; pass token ids instead of a text prompt")
    else:
        text = tok.apply_chat_template(_messages(prompt, system), enable_thinking=think) if chat else prompt
        ids = tok.encode(text)
        if tok.config.get("add_bos_token") is True and tok.bos_id is not None:  # as the GGUF path
            ids = [tok.bos_id, *ids]
        if tok.config.get("add_eos_token") is True and tok.eos_id is not None:
            ids = [*ids, tok.eos_id]
    check_request(None, ids, c.vocab_size, n_ctx, max_new_tokens, block_size or c.block_size)
    cfg = GenerationConfig(
        block_size=block_size or c.block_size, mask_token_id=c.mask_token_id, eos_token_id=c.eos_token_id, **sampling
    )
    try:
        res = generate(TorchBackend(m), ids, cfg, on_block=on_block)
    except NonFiniteError as e:  # never tokens from NaN/Inf logits; the message names the model
        raise NonFiniteError(f"{model}: {e}") from None
    completion = tok.decode(res.tokens) if tok is not None and prompt_ids is None else None
    return RunOutput(completion, ids, res, f"pytorch-{dtype}")


def _context_length(model_dir: Path) -> int:
    """config.json's max_position_embeddings (checked by CloverConfig), else what the converter writes."""
    from ..constants import DEFAULT_CONTEXT_LENGTH

    d = json.loads((model_dir / "config.json").read_text())
    return int(d.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))


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
