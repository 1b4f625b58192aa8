"""What a Clover GGUF's vocabulary and metadata answer without weights or a context: tokens
(special tokens split off in one pass), the chat template, grammars over the vocabulary. The
base of CloverRuntime, and on its own (`Vocab.open`, llama.cpp's vocab_only load) what the
server's preparation workers (serve/prep.py) need, without torch.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

from ..errors import CloverError
from ..inputs import InputError, regular_file
from . import bindings as B


class RuntimeError_(CloverError, RuntimeError):
    """A clover_* call failed."""


class RuntimeLoadError(RuntimeError_):
    """llama.cpp refused the file; the message is one line naming the file and the reason."""


class GrammarError(CloverError, ValueError):
    """llama.cpp's grammar parser refused a GenerationConfig.grammar; the message says why."""


class Vocab:
    """A GGUF's vocabulary (self.model, self.vocab loaded by a subclass, or by `open`)."""

    path: Path

    @classmethod
    def open(cls, gguf_path: str | Path) -> Vocab:
        """The vocabulary and metadata alone (llama.cpp's vocab_only load: no tensor is read)."""
        v = cls.__new__(cls)
        v.path = Path(gguf_path)
        try:
            regular_file(v.path)
        except InputError as e:
            raise RuntimeLoadError(str(e).replace("no such file", "no such GGUF file")) from None
        v._lib = B.load()
        v._log = B.log_capture(v._lib, verbose=False)
        lc = v._lib.lc
        mp = lc.llama_model_default_params()
        mp.vocab_only = True
        v._log.mark()
        with B.stderr_silenced(True):
            v.model = lc.llama_model_load_from_file(str(v.path).encode(), mp)
        if not v.model:
            raise RuntimeLoadError(f"{v.path}: {v._log.reason() or 'llama.cpp could not load its vocabulary'}")
        v._read_vocab()
        return v

    def _check(self, rc: int, what: str) -> int:
        if rc < 0:
            why = self._log.reason()
            raise RuntimeError_(f"{self.path}: {what} failed ({rc}){': ' + why if why else ''}")
        return rc

    def close_vocab(self) -> None:
        if getattr(self, "model", None):
            self._lib.lc.llama_model_free(self.model)
            self.model = None

    def _read_vocab(self) -> None:
        """The model's sizes and special tokens."""
        lc = self._lib.lc
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_layer = lc.llama_model_n_layer(self.model)
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.model))
        self.default_block_size = self._model_block_size()
        self.mask_token_id = lc.llama_vocab_mask(self.vocab)
        eos = lc.llama_vocab_eos(self.vocab)
        self.eos_token_id = eos if eos >= 0 else None
        self.eog = frozenset(t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t))

    def _model_block_size(self) -> int:
        return self._check(self._lib.clover_model_block_size(self.model), "clover_model_block_size")

    def meta(self, key: str) -> str | None:
        return B.meta_str(self._lib, self.model, key)

    @property
    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    # ---------------------------------------------------------------- tokens
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """llama_tokenize's ids. With parse_special, special-token text is split off here, in one
        pass (leftmost, longest first), and each piece between them is tokenized as plain text,
        as llama.cpp does; its own split is quadratic in the specials a text holds
        ("<|im_start|>" x 80,000: 24 s) and cannot be interrupted."""
        if not parse_special or not text:
            return self._tokenize(text, add_special, parse_special)
        rx, ids = self._specials()
        if rx is None:
            return self._tokenize(text, add_special, True)
        out, pos = [], 0
        for m in rx.finditer(text):
            if m.start() > pos:
                out += self._tokenize(text[pos : m.start()], False, False)
            out.append(ids[m.group(0)])
            pos = m.end()
        if pos < len(text):
            out += self._tokenize(text[pos:], False, False)
        if add_special:
            around = self._tokenize("", True, False)  # BOS and/or EOS, as this vocabulary adds them
            n_bos = int(bool(around) and bool(self._lib.lc.llama_vocab_get_add_bos(self.vocab)))
            out = around[:n_bos] + out + around[n_bos:]  # BOS may be EOS's id (clover-tiny's)
        return out

    @property
    def max_token_bytes(self) -> int:
        """The longest token's bytes: a text of n bytes is at least n / this many tokens."""
        if getattr(self, "_max_token_bytes", None) is None:
            self._max_token_bytes = max(1, max(len(self.token_bytes(t)) for t in range(self.n_vocab)))
        return self._max_token_bytes

    def _specials(self):
        """(regex, {text: id}) of the special tokens (control and user-defined), longest first;
        (None, None) when one of them strips spaces around it (llama.cpp's lstrip/rstrip), which
        only llama.cpp's own split handles."""
        if getattr(self, "_special_rx", False) is False:
            import re

            lc = self._lib.lc
            keep = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_USER_DEFINED
            strip = lc.LLAMA_TOKEN_ATTR_LSTRIP | lc.LLAMA_TOKEN_ATTR_RSTRIP
            ids, stripping = {}, False
            for t in range(self.n_vocab):
                a = lc.llama_vocab_get_attr(self.vocab, t)
                if a & keep:
                    text = self.token_bytes(t).decode("utf-8", "replace")
                    if text:
                        ids.setdefault(text, t)
                        stripping |= bool(a & strip)
            if stripping or not ids:
                self._special_rx, self._special_ids = None, None
            else:
                alts = sorted(ids, key=len, reverse=True)
                self._special_rx, self._special_ids = re.compile("|".join(map(re.escape, alts))), ids
        return self._special_rx, self._special_ids

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        lc = self._lib.lc
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (B.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (B.llama_token * n_max)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise RuntimeError_(f"llama_tokenize failed ({n})")
        return list(buf[:n])

    def detokenize(self, ids, remove_special: bool = False, unparse_special: bool = True) -> str:
        lc = self._lib.lc
        ids = [int(i) for i in ids]
        if not ids:
            return ""
        toks = B.token_ptr(ids)
        size = max(64, 8 * len(ids))
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_detokenize(self.vocab, toks, len(ids), buf, size, remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n + 1
        raise RuntimeError_("llama_detokenize failed")

    def token_bytes(self, t: int) -> bytes:
        """The bytes of one token (special tokens as their text)."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.lc.llama_token_to_piece(self.vocab, int(t), buf, len(buf), 0, True)
        return buf.raw[: max(0, n)]

    def chat_prompt(
        self, messages: list[dict], enable_thinking: bool = False, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render the GGUF's chat template (tokenizer.chat_template) with jinja2, the same
        renderer as clover_gguf.tokenizer."""
        from ..tokenizer import TokenizerError, render_chat_template

        tpl = self.chat_template
        if not tpl:
            raise RuntimeError_(f"{self.path} has no tokenizer.chat_template")
        lc = self._lib.lc

        def tok_text(i):
            if i is None or i < 0:
                return None
            return self.detokenize([i], unparse_special=True)

        try:
            return render_chat_template(
                tpl,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                bos_token=tok_text(lc.llama_vocab_bos(self.vocab)),
                eos_token=tok_text(lc.llama_vocab_eos(self.vocab)),
                **kwargs,
            )
        except TokenizerError as e:  # the GGUF's template is broken, or refuses these messages
            raise RuntimeError_(f"{self.path}: tokenizer.chat_template: {e}") from None

    def grammar_sampler(self, grammar: str, triggers: list[int] | None = None) -> int:
        """llama.cpp's grammar sampler for a GBNF grammar (root rule `root`) over this model's
        vocabulary, lazy (it applies from the first trigger token on) when `triggers` are given;
        the caller frees it (llama_sampler_free). GrammarError if it does not parse."""
        lc = self._lib.lc
        g = grammar.encode("utf-8")
        self._log.mark()
        # llama.cpp's grammar parser prints its reason to stderr, not to the log
        with B.stderr_captured() as err:
            if triggers:
                toks = (B.llama_token * len(triggers))(*triggers)
                smpl = lc.llama_sampler_init_grammar_lazy_patterns(self.vocab, g, b"root", None, 0, toks, len(toks))
            else:
                smpl = lc.llama_sampler_init_grammar(self.vocab, g, b"root")
        if not smpl:
            text = err.getvalue()
            why = (
                text.split("error parsing grammar: ", 1)[1].splitlines()[0]
                if "error parsing grammar: " in text
                else None
            )
            raise GrammarError(f"the grammar does not parse: {why or self._log.reason() or 'no reason given'}")
        return smpl

    def check_grammar(self, grammar: str, triggers: list[int] | None = None) -> None:
        """GrammarError unless the grammar parses and (when not lazy) allows a first token."""
        lc = self._lib.lc
        smpl = self.grammar_sampler(grammar, triggers)
        try:
            if triggers:
                return
            n = self.n_vocab
            data = (lc.llama_token_data * n)(*[lc.llama_token_data(t, 0.0, 0.0) for t in range(n)])
            arr = lc.llama_token_data_array(data, n, -1, False)
            lc.llama_sampler_apply(smpl, ctypes.byref(arr))
            if not any(data[i].logit != float("-inf") for i in range(n) if data[i].id != self.mask_token_id):
                raise GrammarError("the grammar matches no text: it allows no first token")
        finally:
            lc.llama_sampler_free(smpl)

    def grammar_step_seconds(self, grammar: str, triggers: list[int] | None = None, rounds: int = 3) -> float:
        """The longest of `rounds` filterings of the whole vocabulary by the grammar, each after
        accepting the first token the previous one allowed (after the trigger, for a lazy one):
        what one constrained position costs, measured on this vocabulary before any request
        decodes (an ambiguous grammar's stacks make it seconds)."""
        lc, n = self._lib.lc, self.n_vocab
        smpl = self.grammar_sampler(grammar, triggers)
        try:
            if triggers:
                lc.llama_sampler_accept(smpl, int(triggers[0]))
            worst = 0.0
            for _ in range(rounds):
                data = (lc.llama_token_data * n)(*[lc.llama_token_data(t, 0.0, 0.0) for t in range(n)])
                arr = lc.llama_token_data_array(data, n, -1, False)
                t0 = time.perf_counter()
                lc.llama_sampler_apply(smpl, ctypes.byref(arr))
                worst = max(worst, time.perf_counter() - t0)
                ok = next((data[i].id for i in range(n) if data[i].logit != float("-inf")
                           and data[i].id != self.mask_token_id and data[i].id not in self.eog), None)  # fmt: skip
                if ok is None:
                    break
                lc.llama_sampler_accept(smpl, ok)
            return worst
        finally:
            lc.llama_sampler_free(smpl)

    def grammar_complete(self, grammar: str, triggers: list[int] | None, tokens: list[int]) -> bool:
        """Whether a reply that ended on an end-of-generation token ended where its grammar may
        end: the tokens accepted in order, then an end token allowed. False when the grammar
        dead-ended (it allowed no token, so libclover ended the sequence: clover.h)."""
        lc = self._lib.lc
        smpl = self.grammar_sampler(grammar, triggers)
        try:
            for t in tokens:
                lc.llama_sampler_accept(smpl, int(t))
            eog = sorted(self.eog)
            data = (lc.llama_token_data * len(eog))(*[lc.llama_token_data(t, 0.0, 0.0) for t in eog])
            arr = lc.llama_token_data_array(data, len(eog), -1, False)
            lc.llama_sampler_apply(smpl, ctypes.byref(arr))
            return any(data[i].logit != float("-inf") for i in range(len(eog)))
        finally:
            lc.llama_sampler_free(smpl)

    def token_id(self, text: str) -> int | None:
        """The id of the one token `text` is (special tokens included), else None."""
        ids = self.tokenize(text)
        return ids[0] if len(ids) == 1 else None
