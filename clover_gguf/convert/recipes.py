"""Which ggml type each GGUF tensor gets.

Rules, in order (the first that applies wins):

1. 1-D tensors (norms, ssm_a, ssm_dt, conv scale, calibration) are always F32, and so are
   the conv and memory-key weights (constants.RUNTIME_F32_TENSORS): the llama.cpp runtime
   uses them as element-wise operands and refuses other types.
2. ``--tensor-type REGEX=TYPE`` overrides, in the order given (regex searched in the GGUF
   tensor name, as llama-quantize's ``--tensor-type``); then the recipe's own overrides.
3. Groups (constants.TENSOR_GROUPS): router, memory (gates, key), conv and norms stay F32;
   routed experts get ``experts``; shared expert, attention, embeddings and output get
   ``outtype``.

Then, if a row is not a multiple of the chosen type's block, llama.cpp's fallback
(quants.fallback_type) picks a compatible type, and the plan reports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType

from ..constants import RUNTIME_F32_TENSORS, tensor_group
from . import quants

F32_GROUPS = ("router", "memory", "conv", "norms")
EXPERT_GROUPS = ("experts_gate_up", "experts_down")
OUTTYPE_GROUPS = ("shared_expert", "attention", "embeddings", "output")

DEFAULT_OUTTYPE = "bf16"
DEFAULT_EXPERTS = "q4_k"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    outtype: str
    experts: str
    tensor_types: tuple[tuple[str, str], ...] = field(default_factory=tuple)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe("f32", "every tensor F32 (reproduces the spec's vectors in llama.cpp to 1e-4)", "f32", "f32"),
        Recipe("bf16", "lossless: every 2-D weight in BF16", "bf16", "bf16"),
        Recipe("q8_0", "Q8_0 everywhere (near lossless, half of BF16)", "q8_0", "q8_0"),
        Recipe("q4_k", "default: experts Q4_K, the rest BF16", "bf16", "q4_k"),
        Recipe(
            "q4_k_m",
            "experts Q4_K with ffn_down_exps one step higher (Q5_K), attention/shared/embeddings Q8_0, output Q6_K",
            "q8_0",
            "q4_k",
            ((r"ffn_down_exps", "q5_k"), (r"^output\.weight$", "q6_k")),
        ),
        Recipe(
            "q5_k_m",
            "experts Q5_K with ffn_down_exps Q6_K, the rest Q8_0",
            "q8_0",
            "q5_k",
            ((r"ffn_down_exps", "q6_k"),),
        ),
        Recipe("q4_0", "experts Q4_0, the rest Q8_0 (needs no libggml)", "q8_0", "q4_0"),
        Recipe("mxfp4", "experts MXFP4 (as gpt-oss), the rest Q8_0 (needs no libggml)", "q8_0", "mxfp4"),
        Recipe(
            "iq4_xs",
            "experts IQ4_XS with ffn_down_exps Q5_K, the rest Q8_0 (use with --imatrix)",
            "q8_0",
            "iq4_xs",
            ((r"ffn_down_exps", "q5_k"),),
        ),
    ]
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    return RECIPES[name]


def parse_tensor_type(spec: str) -> tuple[str, str]:
    """'REGEX=TYPE' -> (regex, type); validates both."""
    if "=" not in spec:
        raise ValueError(f"--tensor-type {spec!r}: expected REGEX=TYPE")
    pat, typ = spec.rsplit("=", 1)
    if not pat:
        raise ValueError(f"--tensor-type {spec!r}: empty regex")
    try:
        re.compile(pat)
    except re.error as e:
        raise ValueError(f"--tensor-type {spec!r}: bad regex ({e})") from None
    quants.parse_type(typ)
    return pat, typ.lower()


@dataclass
class TypeRules:
    outtype: str
    experts: str
    tensor_types: list[tuple[str, str]]  # the user's (n_user first), then the recipe's
    recipe: str | None
    n_user: int = 0

    @classmethod
    def make(
        cls, outtype: str | None = None, experts: str | None = None, tensor_types=None, recipe: str | None = None
    ) -> TypeRules:
        """Explicit outtype/experts win over the recipe's; explicit --tensor-type entries
        come before the recipe's (first match wins)."""
        r = get_recipe(recipe) if recipe else None
        out = (outtype or (r.outtype if r else DEFAULT_OUTTYPE)).lower()
        exp = (experts or (r.experts if r else DEFAULT_EXPERTS)).lower()
        if out not in quants.OUTTYPES:
            raise ValueError(f"--outtype {out!r}: must be one of {', '.join(quants.OUTTYPES)}")
        if exp not in quants.EXPERT_TYPES:
            raise ValueError(f"--experts {exp!r}: must be one of {', '.join(quants.EXPERT_TYPES)}")
        tts = []
        for tt in tensor_types or []:
            tts.append(parse_tensor_type(tt) if isinstance(tt, str) else parse_tensor_type(f"{tt[0]}={tt[1]}"))
        n_user = len(tts)
        if r:
            tts += list(r.tensor_types)
        return cls(out, exp, tts, recipe, n_user)

    @staticmethod
    def why_override(pat: str, typ: str) -> str:
        return f"--tensor-type {pat}={typ}"

    def unused_overrides(self, reasons) -> list[str]:
        """The user's REGEX=TYPE that decided no tensor's type (matched none, or only tensors
        that stay F32, or only tensors an earlier override took)."""
        used = set(reasons)
        return [f"{p}={t}" for p, t in self.tensor_types[: self.n_user] if self.why_override(p, t) not in used]

    def describe(self) -> str:
        s = f"recipe={self.recipe or 'custom'} outtype={self.outtype} experts={self.experts}"
        if self.tensor_types:
            s += " tensor_types=[" + ", ".join(f"{p}={t}" for p, t in self.tensor_types) + "]"
        return s

    def choose(self, gguf_name: str, shape: tuple[int, ...]) -> tuple[GGMLQuantizationType, str]:
        """(requested type, why) for a tensor, before any block-size fallback."""
        if len(shape) < 2:
            return GGMLQuantizationType.F32, "1-D"
        if re.search(RUNTIME_F32_TENSORS, gguf_name):
            return GGMLQuantizationType.F32, "runtime needs F32"
        for pat, typ in self.tensor_types:
            if re.search(pat, gguf_name):
                return quants.parse_type(typ), self.why_override(pat, typ)
        g = tensor_group(gguf_name)
        if g in F32_GROUPS:
            return GGMLQuantizationType.F32, g
        if g in EXPERT_GROUPS:
            return quants.parse_type(self.experts), "experts"
        return quants.parse_type(self.outtype), "outtype"

    def file_type(self) -> int:
        """general.file_type (llama_ftype) from the experts' type, which holds most weights."""
        from gguf import LlamaFileType as F

        m = {
            "q4_k": F.MOSTLY_Q4_K_M,
            "q4_0": F.MOSTLY_Q4_0,
            "q4_1": F.MOSTLY_Q4_1,
            "iq4_nl": F.MOSTLY_IQ4_NL,
            "iq4_xs": F.MOSTLY_IQ4_XS,
            "mxfp4": F.MOSTLY_MXFP4_MOE,
            "q5_k": F.MOSTLY_Q5_K_M,
            "q6_k": F.MOSTLY_Q6_K,
            "q8_0": F.MOSTLY_Q8_0,
            "bf16": F.MOSTLY_BF16,
            "f16": F.MOSTLY_F16,
            "f32": F.ALL_F32,
            "q3_k": F.MOSTLY_Q3_K_M,
            "q2_k": F.MOSTLY_Q2_K,
            "iq3_s": F.MOSTLY_IQ3_S,
            "iq2_s": F.MOSTLY_IQ2_M,  # llama.cpp's IQ2_M files hold IQ2_S experts
            "iq2_m": F.MOSTLY_IQ2_M,
        }
        return int(m[self.experts])
