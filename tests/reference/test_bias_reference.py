"""logit_bias, presence_penalty and frequency_penalty in the reference loop (docs/CONTRACTS.md,
"Logit bias and penalties"), on a backend whose logits are fixed, so that each step's choice
can be worked out by hand; and GenerationConfig.validate's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from clover_gguf.generation.config import PENALTY_LAST_N_MAX, GenerationConfig
from clover_gguf.reference.generate import generate
from clover_gguf.reference.sampling import LogitBias

V, MASK = 8, 1


class Fixed:
    """A LogitsBackend whose every row is the same: token 5 at 10, token 6 at 9, the rest 0."""

    n_vocab = V

    def __init__(self):
        self.row = torch.zeros(V)
        self.row[5], self.row[6] = 10.0, 9.0

    def prefill(self, tokens, block_size):
        pass

    def block_logits(self, block):
        return self.row.expand(len(block), V).clone()

    def commit(self, block):
        pass


def _gen(**kw) -> list[int]:
    cfg = GenerationConfig(**{"max_new_tokens": 8, "block_size": 4, "mask_token_id": MASK} | kw)
    return generate(Fixed(), [5, 5, 6], cfg).tokens


def test_off_changes_nothing():
    assert _gen(steps=4) == [5] * 8
    assert _gen(steps=4, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={6: 0.0}) == [5] * 8
    assert LogitBias.of(GenerationConfig(logit_bias={6: 0.0})) is None


def test_frequency_penalty_counts_earlier_steps_only():
    # one token per step (ties to the lower position): 5 (10 -> 8), 6 (9 -> 7), 5 (8 -> 6), 6, ...
    # the prompt's 5, 5, 6 do not count
    assert _gen(steps=4, frequency_penalty=2.0) == [5, 6] * 4
    # a whole block per step: its tokens were chosen together and do not penalise each other; the
    # next block counts four 5s (10 - 8 = 2 < 9)
    assert _gen(steps=1, frequency_penalty=2.0) == [5] * 4 + [6] * 4


def test_presence_penalty_counts_once():
    # 5 (10 -> 8), then 6 (9 -> 7), then 5 for good (8 > 7 whatever the counts)
    assert _gen(steps=4, presence_penalty=2.0) == [5, 6, 5, 5, 5, 5, 5, 5]
    assert _gen(steps=4, presence_penalty=-2.0) == [5] * 8


def test_logit_bias_before_the_choice():
    assert _gen(steps=4, logit_bias={5: -100}) == [6] * 8
    assert _gen(steps=4, logit_bias={5: -100, 6: -100, 3: 0.5}) == [3] * 8
    assert _gen(steps=4, logit_bias={7: 100}) == [7] * 8
    # with the penalty: 6 (11 -> 9.5), 5 (10 -> 8.5), 6 (9.5 -> 8), 5 (8.5 -> 7), ...
    assert _gen(steps=4, logit_bias={6: 2.0}, frequency_penalty=1.5) == [6, 5] * 4


def test_confidence_is_of_the_biased_logits():
    # threshold 0.9: unbiased, token 5's probability is e^10 / (e^10 + e^9 + 6) = 0.73 < 0.9, one
    # position per step; +3 on token 5 lifts it to 0.98: the whole block in one step
    cfg = dict(max_new_tokens=4, block_size=4, mask_token_id=MASK, threshold=0.9)
    res = generate(Fixed(), [0], GenerationConfig(**cfg))
    assert [b.tokens_per_step for b in res.blocks] == [[1, 1, 1, 1]]
    res = generate(Fixed(), [0], GenerationConfig(**cfg, logit_bias={5: 3.0}))
    assert [b.tokens_per_step for b in res.blocks] == [[4]]


def test_the_window_is_the_reply():
    assert GenerationConfig(max_new_tokens=64).penalty_last_n() == 64
    assert GenerationConfig(max_new_tokens=8, first_block=[1] * 20).penalty_last_n() == 20
    assert GenerationConfig(max_new_tokens=2**31 - 1).penalty_last_n() == PENALTY_LAST_N_MAX
    b = LogitBias({}, 0.0, 1.0, last_n=2)
    for t in (3, 4, 3):
        b.accept(t)
    assert dict(b.count) == {4: 1, 3: 1}  # the last two


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(presence_penalty=2.5), r"presence_penalty 2.5: must be a finite number in \[-2, 2\]"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
        (dict(presence_penalty=math.inf), "presence_penalty"),
        (dict(presence_penalty="1"), "presence_penalty"),
        (dict(logit_bias={3: 100.5}), r"logit_bias\[3\] 100.5: must be a finite number in \[-100, 100\]"),
        (dict(logit_bias={3: math.nan}), r"logit_bias\[3\]"),
        (dict(logit_bias={-1: 1.0}), "token id -1"),
        (dict(logit_bias={"3": 1.0}), "token id '3'"),
        (dict(logit_bias={True: 1.0}), "token id True"),
        (dict(logit_bias=[(3, 1.0)]), "must be a mapping"),
    ],
)
def test_validate_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**bad).validate()


def test_validate_checks_token_ids_against_the_vocabulary():
    GenerationConfig(logit_bias={V - 1: -100, 0: 100}, presence_penalty=-2, frequency_penalty=2).validate(V)
    with pytest.raises(ValueError, match=r"token id 8: must be an integer in \[0, 7\] \(the model's vocabulary\)"):
        GenerationConfig(logit_bias={V: 1.0}).validate(V)
    with pytest.raises(ValueError, match="token id 8"):  # the loop checks against its backend's vocabulary
        _gen(logit_bias={V: 1.0})
