"""llama-server's text routes: POST /apply-template (the prompt a chat request renders to),
/tokenize and /detokenize."""

from __future__ import annotations

import asyncio

from fastapi import Request

from .. import fields
from ..chat import prepare_chat
from ..http import BadRequest, is_int, opt_bool
from .openai_chat import chat_request


async def apply_template(srv, request: Request):
    """The prompt a chat request renders to (tools included), nothing generated."""
    body, ignored = await srv.read(request, fields.CHAT)
    req = chat_request(srv, body, ignored)
    cp = await prepare_chat(srv, req)
    return srv.json({"prompt": cp.text}, srv.ignore(ignored))


async def tokenize(srv, request: Request):
    """`content` (a string), `add_special`, `parse_special`, `with_pieces`."""
    body, ignored = await srv.read(request, fields.TOKENIZE)
    content = body.get("content", "")
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", "content")
    n, most = len(content.encode("utf-8", "surrogatepass")), srv.config.ctx_size * srv.rt.max_token_bytes
    if n > most:  # more than any prompt could hold: bounded work and answer
        raise BadRequest(f"'content' has {n} bytes, more than a prompt of the context's size can ({most})", "content")
    add = bool(opt_bool(body, "add_special"))
    parse = opt_bool(body, "parse_special") is not False
    ids = await asyncio.to_thread(srv.rt.tokenize, content, add, parse)
    if not opt_bool(body, "with_pieces"):
        return srv.json({"tokens": ids}, srv.ignore(ignored))
    pieces = [{"id": t, "piece": _piece(srv.rt.token_bytes(t))} for t in ids]
    return srv.json({"tokens": pieces}, srv.ignore(ignored))


async def detokenize(srv, request: Request):
    """`tokens` (ids) to `content`."""
    body, ignored = await srv.read(request, fields.DETOKENIZE)
    toks = body.get("tokens", [])
    rt = srv.rt
    if not isinstance(toks, list) or not all(is_int(t) for t in toks):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    bad = next((t for t in toks if not 0 <= t < rt.n_vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} in 'tokens' is outside the vocabulary [0, {rt.n_vocab})", "tokens")
    return srv.json({"content": await asyncio.to_thread(rt.detokenize, toks)}, srv.ignore(ignored))


def _piece(b: bytes) -> str | list[int]:
    """A token's text as llama-server's /tokenize gives it: a string, or its bytes when they are
    not valid UTF-8 on their own."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)
