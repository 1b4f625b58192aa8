"""The front doors of `clover-gguf serve`, one module per API, each a translation into the one
internal chat request (serve/chat.py) and out of its reply, with no decoding of its own:
openai_chat (Chat Completions), completions (legacy completions and llama-server's /infill),
anthropic (Messages), responses (Responses), tokens (llama-server's text routes).

ROUTES is the route table: (method, path, handler(srv, request)). An error on a route is said
in its API's shape (ERROR_SHAPES by path prefix; OpenAI's elsewhere).
"""

from __future__ import annotations

from . import anthropic, completions, openai_chat, responses, tokens

ROUTES = [
    ("POST", "/v1/chat/completions", openai_chat.chat_completions),
    ("POST", "/v1/completions", completions.completions),
    ("POST", "/v1/messages", anthropic.messages),
    ("POST", "/v1/messages/count_tokens", anthropic.count_tokens),
    ("POST", "/v1/responses", responses.create),
    ("GET", "/v1/responses/{response_id}", responses.retrieve),
    ("POST", "/infill", completions.infill),
    ("POST", "/apply-template", tokens.apply_template),
    ("POST", "/tokenize", tokens.tokenize),
    ("POST", "/detokenize", tokens.detokenize),
]

ERROR_SHAPES = {"/v1/messages": anthropic.error_response}
