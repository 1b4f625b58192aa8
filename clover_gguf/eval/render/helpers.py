"""What every eval report shares: number and table formatting, spreads as cells, matplotlib
(Agg) and the configuration section."""

from __future__ import annotations

import math

MiB = 1024 * 1024


def fmt_num(x, nd=4, pct=False):
    """A figure for a table cell: "–" for none/NaN, small values in e-notation; pct: x as a percentage."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        v = 100 * x
        if v != 0 and abs(v) < 0.1:
            return f"{v:.2g}"
        return f"{v:.{max(nd - 2, 1)}f}"
    if isinstance(x, int):
        return str(x)
    if x != 0 and abs(x) < 10 ** (-nd):
        return f"{x:.1e}"
    return f"{x:.{nd}f}"


def md_table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def spread_cell(s, scale=1.0, nd=2):
    """A quality.metrics.spread dict as "median [p10–p90]"."""
    if not s or not s.get("n"):
        return "–"
    return f"{s['median'] * scale:.{nd}f} [{s['p10'] * scale:.{nd}f}–{s['p90'] * scale:.{nd}f}]"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def config_markdown(env: dict) -> str:
    cpu, sw, ll = env.get("cpu", {}), env.get("software", {}), env.get("llama_cpp", {})
    gpu = env.get("gpu") or []
    L = [
        "## Configuration",
        "",
        f"- created: {env.get('created_utc')}; command: `{env.get('command')}`",
        f"- CPU: {cpu.get('model')}, {cpu.get('usable_cores')} usable of {cpu.get('logical_cores')} logical cores, "
        f"{cpu.get('memory_gib')} GiB RAM, load average at start {cpu.get('loadavg_at_start')}",
        "- GPU: " + ("; ".join(f"{g['name']} (driver {g['driver']}, {g['memory']})" for g in gpu) if gpu else "none"),
        f"- threads: {env.get('threads')}",
        f"- software: Python {sw.get('python')}, torch {sw.get('torch')}, numpy {sw.get('numpy')}, gguf-py {sw.get('gguf_py')}, "
        f"clover-gguf {sw.get('clover_gguf')} (git {sw.get('git_commit')}), {sw.get('os')}",
    ]
    if ll.get("built"):
        st = ll.get("stamp", {})
        opts = st.get("options", {})
        flags = [a for a in st.get("cmake_args", []) if a.startswith("-D")]
        L.append(
            f"- llama.cpp runtime: llama.cpp commit {ll.get('llama_cpp_commit')} (llama-cpp-python "
            f"{ll.get('llama_cpp_python')}), patch series sha256 {st.get('series_sha256') or ll.get('patch_series_hash')} "
            f"({len(st.get('patches', []))} patches), CUDA {'on' if opts.get('cuda') else 'off'}, compiler "
            f"{ll.get('compiler')}, target {ll.get('build_target')}; cmake: `{' '.join(flags)}`"
        )
    else:
        L.append(
            f"- llama.cpp runtime: not built ({ll.get('why', 'no build stamp')}); patch series hash "
            f"{ll.get('patch_series_hash')}"
        )
    return "\n".join(L) + "\n"
