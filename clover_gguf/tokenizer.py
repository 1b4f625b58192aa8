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
- bos = eos = pad = ``<|endoftext|>`` (0), mask = ``<|mask|>`` (1); no BOS is added on encode.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .constants import TOKENIZER_PRE_NAME

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
DEFAULT_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 8192

# gguf.TokenType values (gguf-py constants)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# Qwen3-style ChatML template with a thinking mode. enable_thinking=false (explicitly) puts an
# empty think block after the generation prompt, so the model answers directly. Assistant
# turns after the last user message keep their reasoning (``reasoning_content`` or a
# <think>...</think> prefix of the content); earlier ones are rendered without it.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message['content'] if message['content'] is string else '' %}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message['reasoning_content'] is string %}\n"
    "            {%- set reasoning_content = message['reasoning_content'] %}\n"
    "        {%- elif '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index and reasoning_content %}\n"
    "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
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


class TokenizerError(RuntimeError):
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


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict:
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
            for i, t in enumerate(SPECIAL_TOKENS)
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


def train_tokenizer(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    texts: Iterable[str] | None = None,
    min_frequency: int = 2,
    verbose: bool = True,
) -> CloverTokenizer:
    """Train the byte-level BPE on the TRAIN split (clover_gguf.data.train_files()) unless
    ``texts`` is given; write tokenizer.json + tokenizer_config.json to ``out_dir``.
    ``vocab_size`` counts the 6 special tokens and the 256 byte symbols."""
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
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


def render_chat_template(template: str, **ctx) -> str:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TokenizerError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**ctx)


class CloverTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict, tokenizer_json: bytes | None = None):
        self._tok = tokenizer
        self.config = config
        self._json = tokenizer_json if tokenizer_json is not None else tokenizer.to_str().encode()

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
            if not f.is_file():
                raise TokenizerError(f"missing {f}")
        raw = tj.read_bytes()
        return cls(Tokenizer.from_str(raw.decode()), json.loads(tc.read_text()), raw)

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
        tj = json.loads(self._json)
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
