"""The patch series (patches/*.patch) applies cleanly, in order, to a fresh unpack of the
llama-cpp-python 0.3.36 sdist. Fast: only the files the patches touch are extracted, then each
patch is `git apply --check`ed and applied in a scratch folder (no build)."""

from __future__ import annotations

import tarfile

from clover_gguf.runtime import build as rb


def _touched(patches):
    out = set()
    for p in patches:
        out.update(rb._patch_paths(p))
    return out


def test_series_applies_to_fresh_sdist(tmp_path):
    patches = rb.patch_series()
    assert patches, "patches/ holds no *.patch"
    sdist = rb.fetch_sdist()
    touched = _touched(patches)
    prefix = f"llama_cpp_python-{rb.LLAMA_CPP_PYTHON_VERSION}/"
    with tarfile.open(sdist) as tf:
        members = []
        for m in tf.getmembers():
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else m.name
            if (
                rel in touched
                or rel.removeprefix("vendor/llama.cpp/") in touched
                and rel.startswith("vendor/llama.cpp/")
            ):
                members.append(m)
        rb.extract_tar(tf, tmp_path, members)
    tree = tmp_path / prefix.rstrip("/")
    tree.mkdir(exist_ok=True)
    (tree / "vendor" / "llama.cpp").mkdir(parents=True, exist_ok=True)
    rb.apply_patches(tree, patches)  # raises BuildError naming the failing patch


def test_series_hash_changes_with_content(tmp_path):
    a, b = tmp_path / "0001-a.patch", tmp_path / "0002-b.patch"
    a.write_text("x")
    b.write_text("y")
    h1 = rb.series_hash([a, b])
    b.write_text("z")
    assert rb.series_hash([a, b]) != h1


def test_series_log_is_for_the_committed_series():
    """scripts/check_series.sh built every prefix of exactly these patches and each passed:
    change the series, run the script again (patches/README.md)."""
    import re

    summary = rb.PATCH_DIR.parent / "evaldata" / "series" / "summary.md"
    text = summary.read_text()
    m = re.search(r"^series: `([0-9a-f]{64})` \((\d+) patches\)$", text, re.M)
    assert m, f"{summary}: no series line"
    patches = rb.patch_series()
    assert m.group(1) == rb.series_hash(patches), f"{summary} is for another series: run scripts/check_series.sh"
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"^\| [1-9]\d* \|", line)]
    assert [r[1].strip() for r in rows] == [p.stem for p in patches]
    assert all("FAIL" not in cell for r in rows for cell in r), [r for r in rows if any("FAIL" in c for c in r)]
    # C-linkage symbols the whole series adds against the base's build (the public API and the CPU
    # op's entry point, evaldata/series/summary.md lists them): a handful at most
    assert int(rows[-1][4]) <= 5, rows[-1]
    assert "test-clover vectors ok, llama-clover-cli ids = llama-diffusion-cli ids ok" in text


def test_generation_is_libclovers_not_libllamas():
    """Block-diffusion generation for serving is libclover's (native/, clover-gguf's own library on
    llama.h's public API): libllama exports no clover_* function, libclover exports every one bound."""
    from clover_gguf.runtime import bindings as B

    lib = B.load()
    bound = [n for n in vars(lib) if n.startswith("clover_") and n != "clover"]
    assert len(bound) >= 20
    assert [n for n in bound if hasattr(lib.lib, n)] == [], "libllama exports clover_* functions"
    assert all(hasattr(lib.clover, n) for n in bound)
    # the generic hooks the driver uses instead of llama_context's internals
    for n in ("llama_set_block_diffusion", "llama_perf_context_graph", "llama_model_output_on_host"):
        assert hasattr(lib.lib, n), n
