"""Importance matrices in llama.cpp's GGUF imatrix format (tools/imatrix/imatrix.cpp).

File: ``general.type = "imatrix"``, ``imatrix.datasets`` [str], ``imatrix.chunk_count`` u32,
``imatrix.chunk_size`` u32, and for each weight tensor W (its GGUF name) two F32 tensors:
``W.in_sum2`` (ggml ne [n_per_row, n_mat]: the sum over activations x of x², per expert
for stacked experts) and ``W.counts`` (ne [1, n_mat]: how many activations were summed).
llama-quantize weights a tensor's rows with in_sum2 / counts (1 where counts is 0); so does
``load_imatrix`` here, bit for bit (float32 division).

``compute_imatrix`` runs the PyTorch reference (clover_gguf.reference.model.CloverModel) on a text
file with forward hooks and counts each routed expert's activations separately.
The model runs the way inference does: every chunk of text goes through both streams of
forward_train: clean blocks (commits) and the same blocks partly masked (denoising steps),
so the statistics cover the mask-token inputs a diffusion model mostly sees at inference.
The last layer's attention output and FFN see the denoising stream only: a commit needs that
layer's state, not its output, so forward_train does not compute it.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..constants import (
    ARCH,
    GENERAL_TYPE_IMATRIX,
    GGUF_EXPERT_NAME,
    IMATRIX_COUNTS_SUFFIX,
    IMATRIX_SUM2_SUFFIX,
    Keys,
    hf_to_gguf_name,
    tensor_group,
)


@dataclass
class Imatrix:
    path: Path | None
    # GGUF tensor name -> weights [n_mat, n_per_row] float32 (in_sum2 / counts, as llama-quantize)
    entries: dict[str, np.ndarray] = field(default_factory=dict)
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def get(self, name: str) -> np.ndarray | None:
        return self.entries.get(name)


def _normalize(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """llama.cpp tools/quantize load_imatrix: e = sums / count, 1 where count == 0 (float32)."""
    sums = sums.astype(np.float32, copy=False)
    c = np.floor(counts.astype(np.float64).reshape(-1) + 0.5).astype(np.float32)  # std::lround
    out = np.empty_like(sums)
    for j in range(sums.shape[0]):
        if c[j] > 0:
            out[j] = sums[j] / np.float32(c[j])
        else:
            out[j] = 1.0
    return out


def load_imatrix(path) -> Imatrix:
    from ..inputs import open_input

    path = Path(path)
    with open_input(path) as f:  # a FIFO would block for ever
        magic = f.read(4)
    if magic != b"GGUF":
        return _load_legacy(path)
    from ..gguf_io.reader import open_gguf

    r = open_gguf(path)
    im = Imatrix(path)
    f = r.fields.get(Keys.IMATRIX_DATASETS)
    if f is not None:
        im.datasets = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
    for key, attr in ((Keys.IMATRIX_CHUNK_COUNT, "chunk_count"), (Keys.IMATRIX_CHUNK_SIZE, "chunk_size")):
        f = r.fields.get(key)
        if f is not None:
            setattr(im, attr, int(f.parts[f.data[0]][0]))
    if (
        Keys.IMATRIX_DATASETS not in r.fields
        or Keys.IMATRIX_CHUNK_COUNT not in r.fields
        or Keys.IMATRIX_CHUNK_SIZE not in r.fields
    ):
        raise ValueError("missing imatrix metadata (imatrix.datasets/chunk_count/chunk_size)")
    sums, counts = {}, {}
    for t in r.tensors:
        if t.tensor_type.name != "F32":
            raise ValueError(f"tensor {t.name} must be F32")
        if t.name.endswith(IMATRIX_SUM2_SUFFIX):
            sums[t.name[: -len(IMATRIX_SUM2_SUFFIX)]] = np.array(t.data, dtype=np.float32)
        elif t.name.endswith(IMATRIX_COUNTS_SUFFIX):
            counts[t.name[: -len(IMATRIX_COUNTS_SUFFIX)]] = np.array(t.data, dtype=np.float32)
    if not sums and not counts:
        raise ValueError("no data in file")
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise ValueError(f"mismatched sums and counts for {name}")
        n_mat = counts[name].size
        s = sums[name].reshape(n_mat, -1)
        im.sums[name] = s
        im.counts[name] = counts[name].reshape(n_mat)
        im.entries[name] = _normalize(s, im.counts[name])
    return im


def _load_legacy(path: Path) -> Imatrix:
    """The old .dat format: sums already divided by count and multiplied by ncall."""
    data = path.read_bytes()
    im = Imatrix(path)
    off = 0

    def take(fmt):
        nonlocal off
        v = struct.unpack_from(fmt, data, off)
        off += struct.calcsize(fmt)
        return v

    try:
        (n,) = take("<i")
        if n < 1:
            raise ValueError("no data in file")
        for _ in range(n):
            (ln,) = take("<i")
            name = data[off : off + ln].decode()
            off += ln
            ncall, nval = take("<ii")
            vals = np.frombuffer(data, dtype=np.float32, count=nval, offset=off).copy()
            off += 4 * nval
            e = vals / np.float32(ncall) if ncall > 0 else vals
            im.entries[name] = e.reshape(1, -1)
    except struct.error:
        raise ValueError("truncated or not an imatrix file") from None
    return im


def write_imatrix(
    path,
    sums: dict[str, np.ndarray],
    counts: dict[str, np.ndarray],
    datasets: list[str],
    chunk_count: int,
    chunk_size: int,
) -> None:
    """Write llama.cpp's GGUF imatrix. sums[name] [n_mat, n_per_row], counts[name] [n_mat]."""
    from gguf import GGUFValueType, GGUFWriter
    from gguf.gguf_writer import WriterState

    from ..outputs import output_file

    w = GGUFWriter(path=None, arch=ARCH)
    w.kv_data[0].clear()  # llama.cpp's imatrix files carry no general.architecture
    w.add_key_value("general.type", GENERAL_TYPE_IMATRIX, GGUFValueType.STRING)
    w.add_key_value(Keys.IMATRIX_DATASETS, list(datasets), GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value(Keys.IMATRIX_CHUNK_COUNT, int(chunk_count), GGUFValueType.UINT32)
    w.add_key_value(Keys.IMATRIX_CHUNK_SIZE, int(chunk_size), GGUFValueType.UINT32)
    for name in sorted(sums):
        s = np.ascontiguousarray(sums[name], dtype=np.float32)
        c = np.ascontiguousarray(counts[name], dtype=np.float32).reshape(-1, 1)
        if s.ndim != 2 or s.shape[0] != c.shape[0]:
            raise ValueError(f"{name}: sums {s.shape} and counts {c.shape} disagree")
        w.add_tensor(name + IMATRIX_SUM2_SUFFIX, s)
        w.add_tensor(name + IMATRIX_COUNTS_SUFFIX, c)
    with output_file(path, force=True) as f:
        w.fout, w.state = [f], WriterState.EMPTY
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


# ---------------------------------------------------------------------------------------
# computing one from the reference model


class _Collector:
    def __init__(self):
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}

    def add_dense(self, name, x):
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        s = (x * x).sum(0).numpy()
        if name not in self.sums:
            self.sums[name] = np.zeros((1, s.shape[0]), np.float64)
            self.counts[name] = np.zeros(1, np.int64)
        self.sums[name][0] += s
        self.counts[name][0] += x.shape[0]

    def add_expert(self, name, n_exp, e, x):
        x = x.detach().to(torch.float64)
        if name not in self.sums:
            self.sums[name] = np.zeros((n_exp, x.shape[-1]), np.float64)
            self.counts[name] = np.zeros(n_exp, np.int64)
        self.sums[name][e] += (x * x).sum(0).numpy()
        self.counts[name][e] += x.shape[0]


# dense matmuls whose inputs are recorded (as the first round did: the router, memory gates
# and the output stay out; the routed experts are recorded per expert)
IMATRIX_DENSE_GROUPS = ("attention", "shared_expert")


def _install_hooks(model, col: _Collector) -> list:
    """Forward hooks that record every quantizable matmul's input. The routed experts: a
    pre-hook on mlp.experts sees the routing (the gate/up inputs per expert), a hook on
    mlp.experts.act its output (the down inputs, rows grouped by expert)."""
    handles = []
    E = model.config.num_experts
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            gname = hf_to_gguf_name(name + ".weight")
            if gname is not None and tensor_group(gname) in IMATRIX_DENSE_GROUPS:
                handles.append(mod.register_forward_pre_hook(lambda m, args, _n=gname: col.add_dense(_n, args[0])))
    for i, layer in enumerate(model.layers):
        names = {p: GGUF_EXPERT_NAME[p].format(bid=i) for p in ("gate", "up", "down")}
        counts: list[int] = []

        def routed(mod, args, _names=names, _counts=counts):
            v, ids, _w = args
            flat = ids.reshape(-1)
            x = v[torch.argsort(flat, stable=True) // ids.shape[-1]]
            _counts[:] = torch.bincount(flat, minlength=E).tolist()
            for e, (a, n) in enumerate(zip(itertools.accumulate([0] + _counts), _counts)):
                if n:
                    col.add_expert(_names["gate"], E, e, x[a : a + n])
                    col.add_expert(_names["up"], E, e, x[a : a + n])

        def down_inputs(mod, args, h, _names=names, _counts=counts):
            a = 0
            for e, n in enumerate(_counts):
                if n:
                    col.add_expert(_names["down"], E, e, h[a : a + n])
                    a += n

        handles.append(layer.mlp.experts.register_forward_pre_hook(routed))
        handles.append(layer.mlp.experts.act.register_forward_hook(down_inputs))
    return handles


def compute_imatrix(
    model_dir,
    text_file,
    out_path,
    n_ctx: int = 512,
    chunks: int | None = None,
    block_size: int | None = None,
    seed: int = 0,
    token_ids=None,
    progress: bool = True,
    log=print,
) -> Imatrix:
    """Run the reference model over ``text_file`` in chunks of ``n_ctx`` tokens and write
    llama.cpp's GGUF imatrix to ``out_path``. ``token_ids`` (a list) bypasses the tokenizer."""
    from ..inputs import read_text, regular_file
    from ..outputs import check_replaceable
    from ..reference.model import CloverModel

    model_dir = Path(model_dir)
    if token_ids is None:
        regular_file(text_file)  # before loading the model
    check_replaceable(out_path, force=True)  # before the work: never a link, FIFO, device, folder
    inputs = [*model_dir.iterdir(), *([Path(text_file)] if text_file is not None else [])]
    if Path(out_path).resolve() in {p.resolve() for p in inputs}:
        raise ValueError(f"{out_path}: refusing to overwrite an input file")
    model = CloverModel.from_pretrained(model_dir, dtype=torch.float32)
    c = model.config
    B = block_size or c.block_size
    if token_ids is None:
        text = read_text(text_file, errors="replace")
        if (model_dir / "tokenizer.json").exists():
            from ..tokenizer import CloverTokenizer

            token_ids = CloverTokenizer.from_dir(model_dir).encode(text)
        else:
            log(f"{model_dir}: no tokenizer.json; using bytes modulo the vocabulary as tokens")
            token_ids = [b % c.vocab_size for b in text.encode()]
    ids = torch.tensor(token_ids, dtype=torch.long)
    n_ctx = max(B, n_ctx // B * B)
    n_chunks = len(ids) // n_ctx
    if chunks is not None:
        n_chunks = min(n_chunks, chunks)
    if n_chunks < 1:
        raise ValueError(f"{text_file}: {len(ids)} tokens, fewer than one chunk of {n_ctx}")
    g = torch.Generator().manual_seed(seed)
    col = _Collector()
    handles = _install_hooks(model, col)
    it = range(n_chunks)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="imatrix", unit="chunk")
    try:
        with torch.no_grad():
            for k in it:
                clean = ids[k * n_ctx : (k + 1) * n_ctx].view(1, -1, B)
                nb = clean.shape[1]
                t = torch.rand(1, nb, 1, generator=g).clamp(min=1e-3)
                m = torch.rand(1, nb, B, generator=g) < t
                noisy = torch.where(m, torch.full_like(clean, c.mask_token_id), clean)
                pos = torch.arange(n_ctx).view(1, nb, B)
                valid = torch.ones_like(clean, dtype=torch.bool)
                model.forward_train(clean, noisy, pos, valid, select=torch.zeros_like(valid))
    finally:
        for h in handles:
            h.remove()
    sums = {k: v.astype(np.float32) for k, v in col.sums.items()}
    counts = {k: v.astype(np.float32) for k, v in col.counts.items()}
    write_imatrix(out_path, sums, counts, [str(text_file)], n_chunks, n_ctx)
    return load_imatrix(out_path)
