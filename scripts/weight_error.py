#!/usr/bin/env python
"""Weight error of quantized GGUFs against the BF16 GGUF of the same model, per tensor group:
relative RMS ||Wq - W|| / ||W||, and with --imatrix the same weighted by each input column's
mean squared activation (what a matmul's output error follows).

    python scripts/weight_error.py BF16.gguf Q4_0-experts.gguf Q4_K-experts.gguf --imatrix im.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clover_gguf.constants import tensor_group  # noqa: E402
from clover_gguf.gguf_io.reader import dequantize_tensor, open_gguf  # noqa: E402


def errors(base: Path, quant: Path, imatrix=None) -> dict:
    """group -> {"rel_rms", "rel_rms_act" (with an imatrix), "types"} over the quantized tensors."""
    ref = {t.name: t for t in open_gguf(base).tensors}
    acc: dict[str, dict] = {}
    for t in open_gguf(quant).tensors:
        if t.tensor_type.name in ("F32", "BF16", "F16") or t.name not in ref:
            continue
        group = tensor_group(t.name)
        w = dequantize_tensor(ref[t.name]).astype(np.float64)
        d = dequantize_tensor(t).astype(np.float64) - w
        a = acc.setdefault(group, {"err": 0.0, "norm": 0.0, "err_act": 0.0, "norm_act": 0.0, "types": set()})
        a["err"] += float((d * d).sum())
        a["norm"] += float((w * w).sum())
        a["types"].add(t.tensor_type.name)
        im = imatrix.get(t.name) if imatrix is not None else None
        if im is not None:  # [n_mat, n_in]: weights rows [.., n_out, n_in]
            c = im.reshape(im.shape[0], 1, -1) if w.ndim == 3 else im.reshape(1, -1)
            a["err_act"] += float((d * d * c).sum())
            a["norm_act"] += float((w * w * c).sum())
    out = {}
    for g, a in acc.items():
        out[g] = {"rel_rms": (a["err"] / a["norm"]) ** 0.5, "types": sorted(a["types"])}
        if a["norm_act"]:
            out[g]["rel_rms_act"] = (a["err_act"] / a["norm_act"]) ** 0.5
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="the BF16 GGUF")
    ap.add_argument("quant", type=Path, nargs="+")
    ap.add_argument("--imatrix", type=Path)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    im = None
    if a.imatrix:
        from clover_gguf.convert.imatrix import load_imatrix

        im = load_imatrix(a.imatrix)
    res = {str(q): errors(a.base, q, im) for q in a.quant}
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    for q, groups in res.items():
        print(q)
        for g, e in sorted(groups.items()):
            act = f", activation-weighted {e['rel_rms_act']:.4f}" if "rel_rms_act" in e else ""
            print(f"  {g:18s} {'/'.join(e['types']):12s} relative RMS {e['rel_rms']:.4f}{act}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
