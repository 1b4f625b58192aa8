"""POST /v1/completions (OpenAI's legacy completions: a prompt, no template) and POST /infill
(llama-server's fill-in-the-middle, by fixing the suffix's tokens inside the one block that is
denoised)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from .. import fields
from .. import logprobs as lp
from ..chat import ContextOverflow, fits
from ..decoding import sampling
from ..engine import Job
from ..http import BadRequest, error_body, is_int, job_error, opt_bool
from .openai_chat import decoding


def context_overflow(srv, n: int, param: str) -> BadRequest | None:
    """OpenAI's wording (litellm maps it to ContextWindowExceededError)."""
    if n <= srv.config.ctx_size:
        return None
    return BadRequest(
        f"This model's maximum context length is {srv.config.ctx_size} tokens. However, your prompt resulted in "
        f"{n} tokens. Please reduce the length of the prompt.",
        param,
        "context_length_exceeded",
    )


async def completions(srv, request: Request):
    rt = srv.rt
    body, ignored = await srv.read(request, fields.COMPLETIONS)
    d = decoding(srv, body, chat=False, ignored=ignored)
    headers = srv.ignore(ignored)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        try:
            fits(rt, prompt, srv.config.ctx_size, "prompt")
        except ContextOverflow as e:
            raise context_overflow(srv, e.n_prompt, "prompt") from None
        ids = await asyncio.to_thread(rt.tokenize, prompt)
    elif isinstance(prompt, list) and all(is_int(t) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < rt.n_vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} in 'prompt' is outside the vocabulary [0, {rt.n_vocab})", "prompt")
        ids = list(prompt)
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if (e := context_overflow(srv, len(ids), "prompt")) is not None:
        raise e
    s = sampling(d, len(ids), srv.limits, 16)
    rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    pend = srv.pending(request)
    try:
        await pend.start(Job(ids, s.cfg, pend.emit, s.stop, s.cache))
        if (ev := pend.refused()) is not None:
            raise job_error(ev)
    except BaseException:
        pend.close()
        raise
    if s.stream:
        sse = _sse(srv, pend, rid, created, s)
        h = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
        return StreamingResponse(sse, media_type="text/event-stream", headers=h)
    try:
        while (ev := await pend.next())["type"] == "block":
            pass
    finally:
        pend.close()  # no-op when done; stops the generation if this handler was cancelled
    if ev["type"] == "error":
        raise job_error(ev)
    choice = {"index": 0, "text": ev["text"], "finish_reason": ev["finish_reason"], "logprobs": None}
    if s.logprobs is not None:
        n = lp.returned(srv.pieces, ev["tokens"], ev["text"])
        choice["logprobs"] = lp.completion(srv.pieces, ev["tokens"][:n], ev["probs"][:n], ev["top"][:n], s.logprobs)
    out = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": srv.config.model_id,
        "choices": [choice],
        "usage": ev["usage"],
    }
    return srv.json(out, headers)


async def _sse(srv, pend, rid, created, s):
    """One `data:` event per block, then one with the finish_reason, then (include_usage) the
    usage-only event, then `[DONE]`."""
    head = {"id": rid, "object": "text_completion", "created": created, "model": srv.config.model_id}
    offset = 0

    def chunk(text: str, finish=None, ev=None) -> str:
        nonlocal offset
        logprobs = None
        if s.logprobs is not None and ev is not None:
            logprobs = lp.completion(srv.pieces, ev["tokens"], ev["probs"], ev["top"], s.logprobs, offset=offset)
            offset += sum(len(t) for t in logprobs["tokens"])
        c = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return f"data: {json.dumps({**head, 'choices': [c]})}\n\n"

    try:
        while True:
            ev = await pend.next()
            if ev["type"] == "block":
                yield chunk(ev["text"], ev=ev if "tokens" in ev else None)
            elif ev["type"] == "error":
                yield f"data: {json.dumps(error_body(ev['message'], etype='server_error'))}\n\n"
                return
            else:
                yield chunk("", ev["finish_reason"])
                if s.include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': ev['usage']})}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:
        pend.close()


async def infill(srv, request: Request):
    """llama-server's /infill fields (input_prefix, input_suffix, prompt), by fixing the suffix's
    tokens inside the one block that is denoised: [n_predict masks][suffix] after the prefix."""
    rt = srv.rt
    body, ignored = await srv.read(request, fields.INFILL)
    headers = srv.ignore(ignored)
    for k in ("input_prefix", "input_suffix", "prompt"):
        if not isinstance(body.get(k) or "", str):
            raise BadRequest(f"'{k}' must be a string", k)
    cache = opt_bool(body, "cache_prompt")
    prefix = await asyncio.to_thread(rt.tokenize, (body.get("input_prefix") or "") + (body.get("prompt") or ""))
    suffix = await asyncio.to_thread(rt.tokenize, body.get("input_suffix") or "")
    n_max = rt.n_ubatch - len(suffix)
    if n_max < 1:
        raise BadRequest(
            f"the suffix has {len(suffix)} tokens: with the middle it must fit in one block of at most "
            f"{rt.n_ubatch} tokens (the context's n_ubatch)",
            "input_suffix",
        )
    key = "n_predict" if body.get("n_predict") is not None else "max_tokens"
    try:
        m = fields.number(body, key, {"n_ubatch": n_max}, "n_predict") or min(rt.default_block_size, n_max)
    except fields.FieldProblem as e:  # max_tokens: llama-server's other name for n_predict here
        raise BadRequest(str(e).replace("'n_predict'", f"'{key}'"), key, e.code) from None
    if (e := context_overflow(srv, len(prefix) + m + len(suffix), "input_prefix")) is not None:
        raise e
    drop = ("n_predict", "max_tokens", "input_prefix", "input_suffix", "prompt", "cache_prompt", "input_extra")
    d = decoding(srv, {k: v for k, v in body.items() if k not in drop}, chat=False)
    s = sampling(d, len(prefix), srv.limits, 16)
    s.cache = s.cache and cache is not False
    block = [rt.mask_token_id] * m + suffix
    s.cfg.first_block, s.cfg.max_new_tokens = block, len(block)
    pend = srv.pending(request)
    try:
        await pend.start(Job(prefix, s.cfg, pend.emit, [], s.cache, [], lambda _t: []))
        while (ev := await pend.next())["type"] == "block":
            pass
    finally:
        pend.close()
    if ev["type"] == "error":
        raise job_error(ev)
    mid = ev["tokens"][:m]
    cut = next((i for i, t in enumerate(mid) if t in rt.eog), len(mid))
    text, stop_type = rt.detokenize(mid[:cut]), "eos" if cut < m else "limit"
    at = min((i for i in (text.find(x) for x in s.stop) if i >= 0), default=-1)
    if at >= 0:  # the middle ends before the first stop string
        text, stop_type = text[:at], "word"
    out = {
        "content": text,
        "model": srv.config.model_id,
        "tokens_predicted": cut,
        "tokens_evaluated": len(prefix),
        "stop": True,
        "stop_type": stop_type,
        "usage": ev["usage"] | {"completion_tokens": cut, "total_tokens": len(prefix) + cut},
    }
    return srv.json(out, headers)
