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
