#!/usr/bin/env python3
"""Fuzz the loaders of a Clover GGUF: llama-clover-cli and the Python side (inspect, the
GGUF reader, CloverRuntime), on mutants of a small valid file.

    python scripts/fuzz_gguf.py --iterations 300               # the CI campaign (fails on a crash or hang)
    python scripts/fuzz_gguf.py --iterations 20000 --seed 7    # a long one
    python scripts/fuzz_gguf.py --replay tests/data/fuzz       # the kept inputs again

Each iteration mutates the metadata region of the base file (spec random-clover, converted
with the default recipe): random byte flips, or a structured change to one key (type, huge,
zero, negative, NaN/Inf, strings, arrays: count, duplicates), one tensor info (dims, n_dims,
type, offset, name) or the header counts. Every mutant runs through

* ``llama-clover-cli -m MUTANT --prompt-ids ... -n 16`` in a subprocess, and
* a forked child of this process: ``inspect``, ``load_gguf_as_hf_tensors`` and
  ``CloverRuntime`` + ``generate``,

each under a memory limit (RLIMIT_AS) and a timeout. Outcomes: ``ok`` (loaded and ran),
``clean`` (refused: exit 1 with one ``error:`` line / the documented exception types),
``crash`` (a signal), ``hang`` (timeout), ``unclean`` (any other exit or exception, or more
than one line). Inputs that crash, hang or are unclean are kept in ``--keep`` (default
tests/data/fuzz/) with a ``.txt`` saying what happened; ``tests/runtime/test_fuzz.py`` replays
them. Exit status 1 when anything but ok/clean happened.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEEP = REPO / "tests" / "data" / "fuzz"
PROMPT_IDS = "1,2,3,4,5,6,7,8,9,10,11"
MEM_LIMIT = 4 << 30  # address space a target may add
CLI: Path | None = None  # --cli
TIMEOUT = 30.0

sys.path.insert(0, str(REPO))  # this checkout's clover_gguf, also when run as a script
from clover_gguf.gguf_io.codec import (  # noqa: E402
    ARR,
    BOOL,
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    INT_TYPES,
    STR,
    U8,
    U16,
    U32,
    U64,
    Gguf,
    parse,
    serialize,
)

# ---- mutations -------------------------------------------------------------------------------


def _copy(g: Gguf) -> Gguf:
    import copy

    return copy.deepcopy(g)


def _other_value(rng, t):
    """A value of type t, often an extreme one."""
    if t == STR:
        return rng.choice([b"", b"none", b"\xff\xfe", b"x" * 70000, b"gpt2", b"qwen2"])
    if t == F32 or t == F64:
        return rng.choice([0.0, -1.0, 1e38, float("inf"), float("-inf"), float("nan"), 1e-45, 3.0])
    if t == BOOL:
        return rng.choice([0, 1, 2, 255])
    lo, hi = {U8: (0, 255), I8: (-128, 127), U16: (0, 65535), I16: (-32768, 32767), U32: (0, 2**32 - 1),
              I32: (-(2**31), 2**31 - 1), U64: (0, 2**64 - 1), I64: (-(2**63), 2**63 - 1)}[t]  # fmt: skip
    return rng.choice([lo, hi, 0, 1, 2, 3, 7, max(lo, -5), min(hi, 1 << 20), min(hi, 10**9), rng.randint(lo, hi)])


def mutate_kv(rng, g: Gguf) -> str:
    kv = rng.choice(g.kvs)
    k = kv.key.decode("utf-8", "replace")
    if kv.type == ARR:
        sub, items = kv.value
        op = rng.choice(["count+", "count-", "count-huge", "dup", "empty", "elem", "subtype", "type", "truncate"])
        if op == "count+":
            kv.count = len(items) + rng.randint(1, 10)
        elif op == "count-":
            kv.count = max(0, len(items) - rng.randint(1, 10))
        elif op == "count-huge":
            kv.count = rng.choice([2**32, 2**62, 2**64 - 1])
        elif op == "dup" and len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            items[i] = items[j]
        elif op == "empty":
            kv.value = (sub, [])
        elif op == "elem" and items:
            i = rng.randrange(len(items))
            items[i] = _other_value(rng, sub)
        elif op == "subtype":
            new = rng.choice([t for t in range(13) if t not in (sub, ARR)])
            kv.value = (new, [_other_value(rng, new) for _ in items[:50]])
        elif op == "truncate":
            kv.value = (sub, items[: rng.randint(0, max(0, len(items) - 1))])
        else:
            new = rng.choice([U32, F32, STR])
            kv.type, kv.value = new, _other_value(rng, new)
        return f"kv {k}: array {op}"
    op = rng.choice(["type", "huge", "zero", "negative", "nan", "inf", "value", "remove", "rename"])
    if op == "type":
        new = rng.choice([t for t in range(13) if t != kv.type])
        kv.type = new
        kv.value = (U32, [1, 2]) if new == ARR else _other_value(rng, new)
    elif op == "remove":
        g.kvs.remove(kv)
    elif op == "rename":
        b = bytearray(kv.key)
        b[rng.randrange(len(b))] = rng.randrange(32, 127)
        kv.key = bytes(b)
    elif kv.type == STR:
        kv.value = _other_value(rng, STR)
    elif op in ("huge", "zero", "negative", "nan", "inf"):
        if kv.type in (F32, F64):
            kv.value = {"huge": 1e38, "zero": 0.0, "negative": -1.0, "nan": float("nan"), "inf": float("inf")}[op]
        elif kv.type in INT_TYPES or kv.type == BOOL:
            if op == "huge":
                kv.value = rng.choice([2**32 - 1, 10**9, 2**31]) if kv.type in (U32, I32, U64, I64) else 255
                if kv.type == I32:
                    kv.value = 2**31 - 1
            elif op == "zero":
                kv.value = 0
            elif op == "negative":
                kv.type, kv.value = I32, -5
            else:
                kv.type, kv.value = F32, float(op)
    else:
        kv.value = _other_value(rng, kv.type)
    return f"kv {k}: {op}"


def mutate_tensor(rng, g: Gguf) -> str:
    ti = rng.choice(g.tis)
    n = ti.name.decode("utf-8", "replace")
    op = rng.choice(
        ["dim0", "dim-huge", "dim+1", "swap", "n_dims", "type", "offset", "offset-huge", "name-dup", "rename"]
    )
    if op == "dim0":
        ti.dims[rng.randrange(len(ti.dims))] = 0
    elif op == "dim-huge":
        ti.dims[rng.randrange(len(ti.dims))] = rng.choice([2**31, 2**40, 2**62, 2**64 - 1])
    elif op == "dim+1":
        i = rng.randrange(len(ti.dims))
        ti.dims[i] += rng.choice([1, -1 if ti.dims[i] > 1 else 1, 32])
    elif op == "swap" and len(ti.dims) > 1:
        ti.dims.reverse()
    elif op == "n_dims":
        ti.n_dims = rng.choice([0, 5, 9, 2**31])
        if ti.n_dims <= 8:
            ti.dims = (ti.dims + [1] * 8)[: ti.n_dims]
            ti.n_dims = None
    elif op == "type":
        ti.type = rng.choice(list(range(0, 45)) + [255, 2**31])
    elif op == "offset":
        ti.offset = rng.choice([o.offset for o in g.tis] + [ti.offset + 1, ti.offset + 32])
    elif op == "offset-huge":
        ti.offset = rng.choice([len(g.data), 2**40, 2**64 - 32])
    elif op == "name-dup":
        ti.name = rng.choice(g.tis).name
    else:
        b = bytearray(ti.name)
        b[rng.randrange(len(b))] = rng.randrange(32, 127)
        ti.name = bytes(b)
    return f"tensor {n}: {op}"


def mutate_header(rng, g: Gguf) -> str:
    op = rng.choice(["n_kv", "n_tensors", "version"])
    if op == "n_kv":
        g.n_kv = rng.choice([len(g.kvs) + 1, len(g.kvs) - 1, 0, 2**63])
    elif op == "n_tensors":
        g.n_tensors = rng.choice([len(g.tis) + 1, len(g.tis) - 1, 0, 2**63])
    else:
        g.version = rng.choice([0, 1, 2, 4, 2**32 - 1])
    return f"header: {op}"


def mutant(rng, base: Gguf, raw_base: bytes, meta_len: int) -> tuple[bytes, str]:
    """One mutant and what was done to it."""
    kind = rng.random()
    if kind < 0.35:  # byte flips in the metadata region
        b = bytearray(raw_base)
        k = rng.choice([1, 1, 2, 3, 8])
        for _ in range(k):
            i = rng.randrange(meta_len)
            b[i] = b[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
        return bytes(b), f"{k} byte flip(s) in the metadata"
    g = _copy(base)
    what = (mutate_kv if kind < 0.8 else mutate_tensor if kind < 0.95 else mutate_header)(rng, g)
    return serialize(g)[0], what


# ---- running the targets ------------------------------------------------------------------------


def _limit(extra: int):
    def f():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not extra:
            return
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))

    return f


def run_cli(cli: Path, path: Path, timeout: float) -> tuple[str, str]:
    try:
        r = subprocess.run(
            [str(cli), "-m", str(path), "--prompt-ids", PROMPT_IDS, "-n", "16", "-t", "1"],
            capture_output=True,
            timeout=timeout,
            preexec_fn=_limit(MEM_LIMIT),
        )
    except subprocess.TimeoutExpired:
        return "hang", f"no exit after {timeout:g} s"
    err = r.stderr.decode("utf-8", "replace").strip()
    if r.returncode < 0:
        return "crash", f"signal {signal.Signals(-r.returncode).name}: {err[-2000:]}"
    if r.returncode == 0:
        return "ok", ""
    if r.returncode == 1 and err.startswith("error: ") and "\n" not in err:
        return "clean", err
    return "unclean", f"exit {r.returncode}: {err[-2000:]}"


def _python_checks(path: Path) -> dict:
    """In the forked child: each Python entry point either works or raises its documented error."""
    from clover_gguf.gguf_io.inspection import format_inspection, inspect_path
    from clover_gguf.gguf_io.reader import GGUFReadError, load_gguf_as_hf_tensors
    from clover_gguf.reference.generate import GenerationConfig
    from clover_gguf.runtime.runtime import CloverRuntime, RuntimeError_

    out = {}

    def check(name, fn, clean_types):
        try:
            fn()
            out[name] = ["ok", ""]
        except clean_types as e:
            msg = str(e)
            out[name] = ["clean", msg] if "\n" not in msg.strip() else ["unclean", msg]
        except BaseException as e:  # noqa: BLE001 - any other exception is a finding
            import traceback

            out[name] = ["unclean", "".join(traceback.format_exception(e))[-3000:]]

    check("inspect", lambda: format_inspection(inspect_path(path), show_tensors=True), (ValueError,))
    check("reader", lambda: load_gguf_as_hf_tensors(path), (GGUFReadError,))

    def runtime():
        rt = CloverRuntime(path, n_threads=1)
        ids = [int(x) for x in PROMPT_IDS.split(",")]
        rt.generate(ids, GenerationConfig(max_new_tokens=16, block_size=rt.default_block_size))

    check("runtime", runtime, (RuntimeError_, ValueError))
    return out


class PythonWorker:
    """A subprocess that imports clover_gguf (torch, libllama) once and runs _python_checks on
    one path per request, under RLIMIT_AS. A crash or hang is that input's; the worker is then
    replaced. (Forking this process per input is not an option: the OpenMP runtime of ggml's
    CPU backend does not survive a fork.)"""

    def __init__(self):
        self.proc = None

    def _start(self):
        self.rd, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(w), "--mem-limit-gb", str(MEM_LIMIT / 2**30)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(w,),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
            cwd=REPO,
        )
        os.close(w)
        self.buf = b""
        self._request("")  # wait until it has imported everything

    def _request(self, line: str, timeout: float = 300.0):
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        t0 = time.time()
        while b"\n" not in self.buf:
            left = timeout - (time.time() - t0)
            r, _, _ = select.select([self.rd], [], [], max(0.0, left))
            if not r:
                return None  # timeout
            chunk = os.read(self.rd, 1 << 16)
            if not chunk:
                return b""  # the worker died
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            os.close(self.rd)
            self.proc = None

    def check(self, path: Path, timeout: float) -> dict[str, tuple[str, str]]:
        res = self._check(path, timeout)
        if "python" in res and self.proc is None:
            # the worker died: the cause may be an earlier input's (a corrupted heap); try alone
            again = self._check(path, timeout)
            if "python" not in again:
                outcome, detail = res["python"]
                return {
                    "python": (outcome, f"{detail}, but not when run alone: an earlier input left the process broken")
                }
        return res

    def _check(self, path: Path, timeout: float) -> dict[str, tuple[str, str]]:
        if self.proc is None:
            self._start()
        got = self._request(str(path), timeout)
        if got is None:
            self._stop()
            return {"python": ("hang", f"no answer after {timeout:g} s")}
        if not got:
            rc = self.proc.wait()
            self._stop()
            if rc < 0:
                return {"python": ("crash", f"signal {signal.Signals(-rc).name}")}
            return {"python": ("unclean", f"worker exit {rc}")}
        return {k: tuple(v) for k, v in json.loads(got).items()}

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            os.close(self.rd)
            self.proc = None


def worker_main(fd: int) -> None:
    """The worker's loop: one path per line on stdin, one JSON line on fd."""
    import torch

    torch.set_num_threads(1)
    _limit(MEM_LIMIT)()
    out = os.fdopen(fd, "w")
    for line in sys.stdin:
        path = line.strip()
        res = _python_checks(Path(path)) if path else {}
        out.write(json.dumps(res) + "\n")
        out.flush()


# ---- the campaign ----------------------------------------------------------------------------------


@dataclass
class Tally:
    counts: dict = field(default_factory=dict)  # target -> outcome -> n
    findings: list = field(default_factory=list)

    def add(self, target: str, outcome: str) -> None:
        self.counts.setdefault(target, {}).setdefault(outcome, 0)
        self.counts[target][outcome] += 1

    @property
    def bad(self) -> int:
        return sum(n for c in self.counts.values() for o, n in c.items() if o not in ("ok", "clean"))


def base_file(work: Path) -> Path:
    """spec random-clover converted with the default recipe (experts Q4_K -> Q5_0 fallback)."""
    from clover_gguf.convert.converter import convert

    out = work / "base.gguf"
    if not out.exists():
        convert(REPO / "tests" / "data" / "spec-vectors" / "random-clover", out, progress=False)
    return out


def find_cli() -> Path:
    if CLI is not None:
        return CLI
    from clover_gguf.runtime import bindings

    lib = Path(bindings.load().lib_path)
    for d in (lib.parent.parent / "bin", lib.parent):  # a runtime dir (lib/ + bin/) or a build's bin/
        if (d / "llama-clover-cli").exists():
            return d / "llama-clover-cli"
    from clover_gguf.runtime.build import runtime_paths

    p = Path(runtime_paths()["bin_dir"]) / "llama-clover-cli"
    if not p.exists():
        raise SystemExit(f"llama-clover-cli not found next to {lib} or in {p.parent}: run `clover-gguf runtime build`")
    return p


def check_one(
    data: bytes, what: str, cli: Path, py: PythonWorker, tally: Tally, keep, timeout: float, tmp: Path
) -> list:
    path = tmp / "mutant.gguf"
    path.write_bytes(data)
    results = {"cli": run_cli(cli, path, timeout), **py.check(path, timeout)}
    bad = []
    for target, (outcome, detail) in results.items():
        tally.add(target, outcome)
        if outcome not in ("ok", "clean"):
            bad.append((target, outcome, detail))
    if bad and keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256(data).hexdigest()[:12]
        name = f"{bad[0][1]}-{bad[0][0]}-{h}"
        (keep / f"{name}.gguf").write_bytes(data)
        (keep / f"{name}.txt").write_text(what + "\n" + "\n".join(f"{t}: {o}: {d}" for t, o, d in bad) + "\n")
    if bad:
        tally.findings.append((what, bad))
    return bad


def campaign(iterations: int, seed: int, keep: Path | None, timeout: float = TIMEOUT, log=print) -> Tally:
    cli = find_cli()
    tally = Tally()
    rng = random.Random(seed)
    py = PythonWorker()
    with tempfile.TemporaryDirectory(prefix="clover-fuzz-") as td:
        tmp = Path(td)
        base_path = base_file(tmp)
        raw = base_path.read_bytes()
        base = parse(raw)
        assert serialize(base)[0] == raw, "the codec does not round-trip the base file"
        meta_len = serialize(base)[1]
        # the base file itself must load and run everywhere
        if check_one(raw, "the base file", cli, py, tally, None, timeout, tmp):
            raise SystemExit(f"the unmutated base file fails: {tally.findings[-1]}")
        t0 = time.time()
        for i in range(iterations):
            data, what = mutant(rng, base, raw, meta_len)
            for target, outcome, detail in check_one(data, what, cli, py, tally, keep, timeout, tmp):
                log(f"[{i}] {what}: {target} {outcome}: {detail.splitlines()[-1] if detail else ''}")
            if (i + 1) % 100 == 0:
                log(f"{i + 1}/{iterations} in {time.time() - t0:.0f} s: {json.dumps(tally.counts)}")
        py.close()
    return tally


def replay(folder: Path, timeout: float = TIMEOUT) -> Tally:
    cli = find_cli()
    tally = Tally()
    py = PythonWorker()
    with tempfile.TemporaryDirectory(prefix="clover-fuzz-") as td:
        for f in sorted(folder.glob("*.gguf")):
            for target, outcome, detail in check_one(f.read_bytes(), f.name, cli, py, tally, None, timeout, Path(td)):
                print(f"{f.name}: {target} {outcome}: {detail.splitlines()[-1] if detail else ''}")
        py.close()
    return tally


def main(argv=None) -> int:
    global MEM_LIMIT, CLI
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", type=Path, default=KEEP, help="Where failing inputs are kept (default tests/data/fuzz).")
    ap.add_argument("--no-keep", action="store_true", help="Keep nothing.")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="Seconds per target and input.")
    ap.add_argument("--replay", type=Path, help="Run the kept inputs of this folder instead of mutants.")
    ap.add_argument("--cli", type=Path, help="llama-clover-cli to run (default: the built runtime's).")
    ap.add_argument(
        "--mem-limit-gb",
        type=float,
        default=MEM_LIMIT / 2**30,
        help="Address space a target may add (0: none, for ASan).",
    )
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    MEM_LIMIT, CLI = int(a.mem_limit_gb * 2**30), a.cli
    if a.worker is not None:
        worker_main(a.worker)
        return 0
    if a.iterations < 0 or not math.isfinite(a.timeout) or a.timeout <= 0:
        ap.error("--iterations must be >= 0 and --timeout > 0")
    t0 = time.time()
    if a.replay:
        tally = replay(a.replay, a.timeout)
    else:
        tally = campaign(a.iterations, a.seed, None if a.no_keep else a.keep, a.timeout)
    print(f"done in {time.time() - t0:.0f} s: {json.dumps(tally.counts)}")
    print(f"crashes, hangs or unclean results: {tally.bad}")
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
