"""The configuration that travels with every eval figure: hardware, software, build, files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def cpu_info() -> dict:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "model": model or platform.processor(),
        "logical_cores": os.cpu_count(),
        "usable_cores": affinity,
        "memory_gib": mem,
        "loadavg_at_start": load,
        "machine": platform.machine(),
    }


def gpu_info() -> list[dict]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    return gpus


def software_info() -> dict:
    import numpy
    import torch

    from .. import __version__

    d = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "clover_gguf": __version__,
        "os": platform.platform(),
    }
    try:
        import gguf

        d["gguf_py"] = getattr(gguf, "__version__", None) or _dist_version("gguf")
    except ImportError:
        pass
    d["git_commit"] = _git_commit()
    return d


def _dist_version(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _git_commit() -> str | None:
    from ..util import REPO_ROOT as root

    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None


def runtime_build_info() -> dict:
    """llama.cpp build facts from the runtime's stamp (commit, patch series hash, CUDA,
    compile options); {'built': False} when there is no build."""
    try:
        from ..runtime.build import runtime_paths

        p = runtime_paths()
    except Exception as e:
        return {"built": False, "why": f"{type(e).__name__}: {e}"}
    stamp = p.get("stamp")
    info = {"built": bool(stamp and Path(stamp).is_file()), "lib_dir": str(p.get("lib_dir"))}
    if info["built"]:
        try:
            info["stamp"] = json.loads(Path(stamp).read_text())
        except (OSError, ValueError) as e:
            info["stamp_error"] = str(e)
    bdir = p.get("build_dir")
    bi = Path(bdir) / "common" / "build-info.cpp" if bdir else None
    if bi is not None and bi.is_file():
        import re

        txt = bi.read_text()
        for key, name in (
            ("LLAMA_COMMIT", "llama_cpp_commit"),
            ("LLAMA_COMPILER", "compiler"),
            ("LLAMA_BUILD_TARGET", "build_target"),
        ):
            m = re.search(key + r'\s*=\s*"([^"]*)"', txt)
            if m:
                info[name] = m.group(1)
    try:
        from ..runtime import build as b

        info["llama_cpp_python"] = b.LLAMA_CPP_PYTHON_VERSION
        pats = b.patch_series()
        info["patch_series_hash"] = b.series_hash(pats) if pats else None
        info["patches"] = [x.name for x in pats]
    except Exception:
        pass
    return info


def environment(threads: int | None = None) -> dict:
    return {
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        "software": software_info(),
        "threads": threads,
        "llama_cpp": runtime_build_info(),
    }


def gguf_file_info(path) -> dict:
    """Size, sha256, tensor types by group, bpw and the converter's recipe key of a GGUF."""
    from ..constants import Keys, tensor_group
    from ..gguf_io.reader import open_gguf
    from ..util import sha256_file

    path = Path(path)
    r = open_gguf(path)
    by_group: dict[str, dict[str, int]] = {}
    n_params, tensor_bytes = 0, 0
    for t in r.tensors:
        g = tensor_group(t.name)
        tn = t.tensor_type.name
        by_group.setdefault(g, {})
        by_group[g][tn] = by_group[g].get(tn, 0) + 1
        n_params += int(t.n_elements)
        tensor_bytes += int(t.n_bytes)
    rec = r.fields.get(Keys.RECIPE)
    recipe = None
    if rec is not None:
        try:
            recipe = rec.contents()
        except Exception:
            recipe = None
    return {
        "path": str(path),
        "name": path.stem,
        "bytes": path.stat().st_size,
        "tensor_bytes": tensor_bytes,
        "n_params": n_params,
        "bpw": 8.0 * tensor_bytes / max(n_params, 1),
        "sha256": sha256_file(path),
        "types": {g: by_group[g] for g in sorted(by_group)},
        "recipe": recipe,
    }
