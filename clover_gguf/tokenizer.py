"""clover-tiny's tokenizer: byte-level BPE (Qwen2-style pre-tokenizer), trained here on the
train split of the stdlib corpus (clover_gguf.data), and a transformers-free loader.

Files (HF layout): ``tokenizer.json`` (the `tokenizers` pipeline) and
``tokenizer_config.json`` (special tokens, ``chat_template``).

Choices (spec section 5 fixes only "byte-level BPE, Qwen2-style pre-tokenizer", the special
tokens and a thinking-mode chat template):
- Pre-tokenizer exactly as Qwen2's tokenizer.json: Split(Qwen2 regex, isolated) then
  ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False); ByteLevel decoder.
  llama.cpp's ``tokenizer.ggml.pre = "qwen2"`` uses the same regex.
- No normalizer (Qwen2 has NFC). Without it encode/decode is byte-exact on any text, and
  llama.cpp (which does not apply NFC for BPE vocabularies) tokenizes identically.
- Specials at fixed ids 0-5. ``<|endoftext|>``, ``<|mask|>``, ``<|im_start|>``, ``<|im_end|>``
  are special added tokens (GGUF CONTROL); ``<think>``/``</think>`` are non-special added
  tokens (GGUF USER_DEFINED), as in Qwen3, so decode keeps them.
- The tool-call tokens (spec section 5) follow the BPE (ids 4096-4099), USER_DEFINED too.
- bos = eos = pad = ``<|endoftext|>`` (0), mask = ``<|mask|>`` (1); no BOS is added on encode.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .constants import TOKENIZER_PRE_NAME
from .errors import CloverError
from .inputs import DuplicateKeyError, InputError, loads_json, read_bytes, read_text
from .outputs import write_json, write_text

QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

EOT, MASK, IM_START, IM_END, THINK, END_THINK = (
    "<|endoftext|>",
    "<|mask|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
)
SPECIAL_TOKENS = [EOT, MASK, IM_START, IM_END, THINK, END_THINK]  # ids 0..5
CONTROL_TOKENS = frozenset({EOT, MASK, IM_START, IM_END})  # special=True
MODEL_MAX_LENGTH = 8192
# tokenizer.json and tokenizer_config.json are read whole: a larger one is refused unread. Qwen3's
# tokenizer.json (151,669 tokens and their merges) is about 11 MB, Gemma 3's (262,144) about
# 33 MB, the largest in wide use: 64 MiB leaves room for twice that.
MAX_TOKENIZER_FILE = 64 << 20

# gguf.TokenType values (gguf-py constants)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# Tool-call tokens (spec section 5), appended after the BPE vocabulary (ids V_bpe .. V_bpe+3).
# Non-special added tokens (GGUF USER_DEFINED) as in Qwen3, so that decoding keeps them and the
# server can parse the calls out of the text.
TOOL_CALL, END_TOOL_CALL, TOOL_RESPONSE, END_TOOL_RESPONSE = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
TOOL_TOKENS = [TOOL_CALL, END_TOOL_CALL, TOOL_RESPONSE, END_TOOL_RESPONSE]


def tool_call_sections(text: str) -> list[tuple[int, int, int | None]]:
    """(start, body start, end tag's index or None when left open) of each `<tool_call>`
    section of a reply. A section ends at the first `</tool_call>` outside a JSON string: the
    tag is one token the model may also write inside an argument, and that must not split the
    call."""
    out, i = [], text.find(TOOL_CALL)
    while i >= 0:
        body = i + len(TOOL_CALL)
        j = _end_tag(text, body)
        out.append((i, body, j))
        if j is None:
            break
        i = text.find(TOOL_CALL, j + len(END_TOOL_CALL))
    return out


def _end_tag(text: str, i: int) -> int | None:
    in_str = escaped = False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "<" and text.startswith(END_TOOL_CALL, j):
            return j
    return None


BPE_VOCAB_SIZE = 4096  # the trained byte-level BPE, its 6 special tokens included
DEFAULT_VOCAB_SIZE = BPE_VOCAB_SIZE + len(TOOL_TOKENS)

# Qwen3-style ChatML template with a thinking mode and tools (spec section 5).
# - enable_thinking=false (explicitly) puts an empty think block after the generation prompt, so
#   the model answers directly. Assistant turns after the last user message keep their reasoning
#   (``reasoning_content`` or a <think>...</think> prefix of the content); earlier ones are
#   rendered without it.
# - With `tools`, the system turn ends with a <tools> section (one JSON signature per line) and
#   the instruction to answer a call as <tool_call>{"name", "arguments"}</tool_call>.
# - An assistant turn's `tool_calls` follow its content, one <tool_call> section each, in exactly
#   the form a call is generated in (arguments given as a string are copied verbatim), so a
#   reply parsed into tool_calls renders back to the same tokens.
# - `tool` messages go into one user turn per run of them, each as <tool_response>.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string %}\n"
    "        {{- messages[0]['content'] + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' + (tool | tojson) }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message['content'] if message['content'] is string else '' %}\n"
    "    {%- if message['role'] == 'system' and loop.first and tools %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message['reasoning_content'] is string %}\n"
    "            {%- set reasoning_content = message['reasoning_content'] %}\n"
    "        {%- elif '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index and reasoning_content %}\n"
    "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>assistant\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message['tool_calls'] %}\n"
    "            {%- for tool_call in message['tool_calls'] %}\n"
    "                {%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "                {%- if tool_call['function'] %}{%- set tool_call = tool_call['function'] %}{%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}\n"
    "                {%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}\n"
    "                {%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message['role'] == 'tool' %}\n"
    "        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)


class TokenizerError(CloverError, RuntimeError):
    pass


# --- training --------------------------------------------------------------------------


def _bpe_pipeline() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def tokenizer_config(n_bpe: int = BPE_VOCAB_SIZE, model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """tokenizer_config.json for a BPE of n_bpe tokens (ids 0..5 the specials) followed by the
    tool tokens."""
    added = list(enumerate(SPECIAL_TOKENS)) + [(n_bpe + j, t) for j, t in enumerate(TOOL_TOKENS)]
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t in CONTROL_TOKENS,
            }
            for i, t in added
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "mask_token": MASK,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _add_tool_tokens(tok: Tokenizer) -> None:
    n = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    for j, t in enumerate(TOOL_TOKENS):
        if tok.token_to_id(t) != n + j:
            raise TokenizerError(f"tool token {t} got id {tok.token_to_id(t)}, expected {n + j}")


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, n_bpe: int) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "tokenizer.json", tok.to_str(pretty=True))
    write_json(out / "tokenizer_config.json", tokenizer_config(n_bpe), indent=2)


def add_tool_tokens(src_dir: str | Path, out_dir: str | Path) -> CloverTokenizer:
    """A tokenizer without the tool tokens (clover-tiny v2) with them appended, and this
    module's chat template: the BPE and every existing id are unchanged."""
    src = CloverTokenizer.from_dir(src_dir)
    if src.token_to_id(TOOL_CALL) is not None:
        raise TokenizerError(f"{src_dir} already has the tool tokens")
    tok = Tokenizer.from_str(src._json.decode())
    n_bpe = tok.get_vocab_size(with_added_tokens=True)
    _add_tool_tokens(tok)
    save_tokenizer(tok, out_dir, n_bpe)
    return CloverTokenizer.from_dir(out_dir)


def train_tokenizer(
    out_dir: str | Path,
    vocab_size: int = BPE_VOCAB_SIZE,
    texts: Iterable[str] | None = None,
    min_frequency: int = 2,
    verbose: bool = True,
) -> CloverTokenizer:
    """Train the byte-level BPE on the TRAIN split (clover_gguf.train.data.train_files()) unless
    ``texts`` is given; write tokenizer.json + tokenizer_config.json to ``out_dir``.
    ``vocab_size`` is the BPE's, counting the 6 special tokens and the 256 byte symbols; the 4
    tool tokens follow it."""
    if texts is None:
        from .train.data import read_corpus, train_files

        texts = read_corpus(train_files())
    texts = list(texts)
    t0 = time.time()
    tok = _bpe_pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS if t in CONTROL_TOKENS]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS if t not in CONTROL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise TokenizerError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise TokenizerError(
            f"trained vocab has {tok.get_vocab_size(with_added_tokens=True)} "
            f"tokens, asked for {vocab_size} (corpus too small?)"
        )
    _add_tool_tokens(tok)
    out = Path(out_dir)
    save_tokenizer(tok, out, vocab_size)
    if verbose:
        print(
            f"trained BPE vocab={vocab_size} on {len(texts)} texts "
            f"({sum(map(len, texts))} chars) in {time.time() - t0:.1f}s -> {out}"
        )
    return CloverTokenizer.from_dir(out)


# --- loading ---------------------------------------------------------------------------


@dataclass
class GGUFVocab:
    """What a GGUF writer needs (llama.cpp 'gpt2' BPE vocabulary)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    mask_id: int
    model: str = "gpt2"
    pre: str = TOKENIZER_PRE_NAME
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    extra: dict = field(default_factory=dict)


# What rendering a chat template may cost (a template is a program from the model file): the
# output, the time, and the iterations of `range` in one render. A hostile template rendered for
# ever (nested range(100000) loops), took 4-5 GB ('x' * 2000000000, tojson(indent=1e9)).
TEMPLATE_LIMITS = {"seconds": 5.0, "output_chars": 64 << 20, "range_items": 1_000_000, "indent": 16}


class TemplateBudget(TokenizerError):
    """A chat template past TEMPLATE_LIMITS; the message says which limit."""


class _Render(threading.local):
    deadline = 0.0
    items = 0


_RENDER = _Render()


def _check_time():
    if time.perf_counter() > _RENDER.deadline:
        raise TemplateBudget(f"the chat template takes longer than {TEMPLATE_LIMITS['seconds']:g} s to render")


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    import jinja2.utils
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    lim = TEMPLATE_LIMITS

    class Env(ImmutableSandboxedEnvironment):
        """The sandbox, with the time checked at every item and attribute lookup, and the sizes
        of `*` and `**` checked before they are computed."""

        intercepted_binops = frozenset(["*", "**"])

        def getitem(self, obj, argument):
            _check_time()
            return super().getitem(obj, argument)

        def getattr(self, obj, attribute):
            _check_time()
            return super().getattr(obj, attribute)

        def call_binop(self, context, operator, left, right):
            _check_time()
            if operator == "**" and isinstance(right, int | float) and abs(right) > 64:
                raise TemplateBudget("the chat template raises a number to a power past 64")
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, str | list | tuple) and isinstance(b, int) and len(a) * b > lim["output_chars"]:
                        raise TemplateBudget(f"the chat template builds a value past {lim['output_chars']} items")
            return super().call_binop(context, operator, left, right)

    def bounded_range(*args):
        r = range(*args)
        _RENDER.items += len(r)
        if _RENDER.items > lim["range_items"]:
            raise TemplateBudget(f"the chat template's loops take more than {lim['range_items']} range items")
        return r

    def tojson(x, indent=None):
        if indent is not None and not (isinstance(indent, int) and 0 <= indent <= lim["indent"]):
            raise TemplateBudget(f"tojson(indent={str(indent)[:20]}): at most {lim['indent']}")
        return json.dumps(x, ensure_ascii=False, indent=indent)

    def raise_exception(msg):
        raise TokenizerError(msg)

    class Namespace(jinja2.utils.Namespace):
        """namespace(), whose values are checked as they are set (`ns.s = ns.s ~ ns.s` doubles)."""

        def __setitem__(self, name, value):
            _check_time()
            if isinstance(value, str | list | tuple) and len(value) > lim["output_chars"]:
                raise TemplateBudget(f"the chat template builds a value past {lim['output_chars']} items")
            super().__setitem__(name, value)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["namespace"] = Namespace
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["range"] = bounded_range
    return env.from_string(template)


def render_chat_template(template: str, **ctx) -> str:
    """The template rendered in the sandbox within TEMPLATE_LIMITS (TemplateBudget past one)."""
    # compiled once per template: rendering training transcripts calls this tens of thousands of times
    lim = TEMPLATE_LIMITS
    _RENDER.deadline, _RENDER.items = time.perf_counter() + lim["seconds"], 0
    try:
        out, n = [], 0
        for piece in _compiled_template(template).generate(**ctx):
            n += len(piece)
            if n > lim["output_chars"]:
                raise TemplateBudget(f"the chat template writes more than {lim['output_chars']} characters")
            _check_time()
            out.append(piece)
        return "".join(out)
    except TokenizerError:
        raise
    except MemoryError:
        raise TemplateBudget("the chat template needs more memory than there is") from None
    except RecursionError:
        raise TemplateBudget("the chat template recurses too deep") from None
    except Exception as e:  # a broken template (syntax, undefined names, a bad filter call): its fault
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise TokenizerError(f"the chat template does not render ({why})") from None


# A conversation with everything a Clover template renders: a system turn, tools, a call, its
# result, reasoning; rendered once by `convert` before the template goes into a GGUF
TEMPLATE_PROBE = {
    "messages": [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Count the lines of os.py."},
        {"role": "assistant", "content": "", "reasoning_content": "A tool counts them.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "count_lines", "arguments": '{"path": "os.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1121"},
        {"role": "assistant", "content": "os.py has 1121 lines."},
        {"role": "user", "content": "Thanks."},
    ],
    "tools": [{"type": "function", "function": {"name": "count_lines", "description": "Count the lines of a file.",
               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}],
}  # fmt: skip


def check_chat_template(template: str, where: str) -> None:
    """Render the template on TEMPLATE_PROBE, thinking on and off, within TEMPLATE_LIMITS:
    TokenizerError naming `where` if it fails or is past a limit (a model file whose template
    renders for ever would hold every server and CLI that loads it)."""
    for thinking in (True, False):
        try:
            render_chat_template(template, add_generation_prompt=True, enable_thinking=thinking, **TEMPLATE_PROBE)
        except TokenizerError as e:
            raise TokenizerError(f"{where}: chat_template: {e}") from None


class CloverTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict, tokenizer_json: bytes | None = None):
        self._tok = tokenizer
        self.config = config
        self._json = tokenizer_json if tokenizer_json is not None else tokenizer.to_str().encode()
        self.source: Path | None = None  # the tokenizer.json it was read from (from_dir)

        def sid(key):
            t = config.get(key)
            if t is None:
                return None
            i = tokenizer.token_to_id(t)
            if i is None:
                raise TokenizerError(f"{key} {t!r} is not in the vocabulary")
            return i

        self.bos_id = sid("bos_token")
        self.eos_id = sid("eos_token")
        self.pad_id = sid("pad_token")
        self.mask_id = sid("mask_token")
        self.chat_template = config.get("chat_template")

    @classmethod
    def from_dir(cls, path: str | Path) -> CloverTokenizer:
        path = Path(path)
        tj, tc = path / "tokenizer.json", path / "tokenizer_config.json"
        for f in (tj, tc):
            if not f.exists():
                raise TokenizerError(f"missing {f}")
        try:  # bounded: a FIFO or device would block or never end, a huge file fill the memory
            raw, conf = read_bytes(tj, max_bytes=MAX_TOKENIZER_FILE), read_text(tc, max_bytes=MAX_TOKENIZER_FILE)
        except InputError as e:
            raise TokenizerError(str(e)) from None
        try:
            config = loads_json(conf)
        except DuplicateKeyError as e:
            raise TokenizerError(f"{tc}: key '{e.key}' is given more than once") from None
        tok = cls(Tokenizer.from_str(raw.decode()), config, raw)
        tok.source = tj
        return tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def fingerprint(self) -> str:
        """sha256 of tokenizer.json (cache keys)."""
        return hashlib.sha256(self._json).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids; special-token strings in ``text`` become their ids; no BOS/EOS added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True, **kwargs
    ) -> str:
        if not self.chat_template:
            raise TokenizerError("tokenizer_config.json has no chat_template")
        return render_chat_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self.config.get("bos_token"),
            eos_token=self.config.get("eos_token"),
            **kwargs,
        )

    def to_gguf_vocab(self) -> GGUFVocab:
        try:  # the tokenizers library keeps the last of a key given twice; the GGUF gets neither
            tj = loads_json(self._json)
        except DuplicateKeyError as e:
            raise TokenizerError(f"{self.source or 'tokenizer.json'}: key '{e.key}' is given more than once") from None
        added = {a["id"]: a for a in tj.get("added_tokens", [])}
        tokens, types = [], []
        for i in range(self.vocab_size):
            t = self._tok.id_to_token(i)
            if t is None:
                raise TokenizerError(f"no token for id {i}")
            tokens.append(t)
            if i in added:
                types.append(TOKEN_CONTROL if added[i]["special"] else TOKEN_USER_DEFINED)
            else:
                types.append(TOKEN_NORMAL)
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        if self.chat_template:
            where = self.source.with_name("tokenizer_config.json") if self.source else "tokenizer_config.json"
            check_chat_template(self.chat_template, str(where))
        return GGUFVocab(
            tokens=tokens,
            token_types=types,
            merges=merges,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            mask_id=self.mask_id,
            add_bos=bool(self.config.get("add_bos_token", False)),
            add_eos=bool(self.config.get("add_eos_token", False)),
            chat_template=self.chat_template,
        )
