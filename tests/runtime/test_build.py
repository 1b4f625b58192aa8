"""build_runtime's decision to skip the compile (stamp + libllama checks) and what it writes
then, in a scratch runtime root: no cmake, no ninja, no pip (install=False)."""

from __future__ import annotations

import json

from clover_gguf.runtime import build as rb


def _fake_build(root, opts, patches, lib=b"libllama"):
    """A runtime root whose build dir holds the stamp of `opts` and a libllama.so, with lib/
    holding `lib`."""
    dirs = rb.RuntimeDirs.under(root, opts.cuda)
    (dirs.build / "bin").mkdir(parents=True)
    (dirs.build / "bin" / "libllama.so").write_bytes(b"libllama")
    dirs.lib_dir.mkdir()
    (dirs.lib_dir / "libllama.so").write_bytes(lib)
    dirs.stamp_path.write_text(json.dumps(rb.build_stamp(dirs, opts, patches)))
    return dirs


def test_up_to_date_build_is_skipped_and_recorded(tmp_path):
    patches = rb.patch_series()
    dirs = _fake_build(tmp_path, rb.BuildOptions(), patches)
    res = rb.build_runtime(root=tmp_path, install=False)
    assert res.skipped
    assert (res.root, res.src_dir, res.build_dir, res.lib_dir, res.bin_dir, res.stamp) == (
        tmp_path,
        dirs.src,
        dirs.build,
        dirs.lib_dir,
        dirs.bin_dir,
        dirs.stamp_path,
    )
    assert res.patches == [p.name for p in patches]
    assert set(res.seconds) == {"fetch", "total"}
    assert not dirs.src.exists()  # nothing unpacked
    info = json.loads((tmp_path / "runtime.json").read_text())
    assert info == {
        "lib_dir": str(dirs.lib_dir),
        "bin_dir": str(dirs.bin_dir),
        "stamp": str(dirs.stamp_path),
        "build_dir": str(dirs.build),
        "src_dir": str(dirs.src),
        "cuda": False,
    }
    paths = rb.runtime_paths(tmp_path)
    assert (paths["stamp"], paths["build_dir"]) == (dirs.stamp_path, dirs.build)


def test_partial_build_is_skipped_and_not_installed(tmp_path):
    patches = rb.patch_series()
    opts = rb.BuildOptions(cuda=True, targets=("ggml-cuda",))
    dirs = _fake_build(tmp_path, opts, patches, lib=b"other")  # a partial build ignores lib/
    res = rb.build_runtime(cuda=True, targets=["ggml-cuda"], root=tmp_path)
    assert res.skipped and res.build_dir == dirs.build and res.build_dir.name == "build-cuda"
    assert not (tmp_path / "runtime.json").exists()


def test_stamp_mismatch_means_a_rebuild(tmp_path):
    patches = rb.patch_series()
    opts = rb.BuildOptions()
    dirs = _fake_build(tmp_path, opts, patches)
    stamp = rb.build_stamp(dirs, opts, patches)
    assert rb.stamp_matches(dirs, stamp, partial=False)
    assert not rb.stamp_matches(dirs, rb.build_stamp(dirs, rb.BuildOptions(rpc=False), patches), partial=False)
    assert not rb.stamp_matches(dirs, rb.build_stamp(dirs, opts, patches[:-1]), partial=False)
    (dirs.lib_dir / "libllama.so").write_bytes(b"stale")
    assert not rb.stamp_matches(dirs, stamp, partial=False)  # lib/ is not this build's
    assert rb.stamp_matches(dirs, stamp, partial=True)
    dirs.stamp_path.write_text("{not json")
    assert not rb.stamp_matches(dirs, stamp, partial=True)
