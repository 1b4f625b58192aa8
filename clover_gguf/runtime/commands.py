"""`clover-gguf runtime build` and `clover-gguf runtime paths`. Registered in cli.py."""

from __future__ import annotations

import click

from ..options import option_type


@click.group("runtime")
def runtime_group():
    """The patched llama.cpp runtime (llama-cpp-python 0.3.36 + patches/)."""


@runtime_group.command("build")
@click.option("--cuda", is_flag=True, help="Build the CUDA backend too (GGML_CUDA=ON, FA off).")
@click.option(
    "--portable",
    is_flag=True,
    help="CPU kernels for any x86-64/ARM CPU (GGML_NATIVE=OFF) instead of this machine's instruction set.",
)
@click.option(
    "--cuda-arch",
    "cuda_arch",
    default=None,
    help="CMAKE_CUDA_ARCHITECTURES, ';' or ',' separated (default 86;89;120;80;90;100).",
)
@click.option("--jobs", "-j", type=option_type("jobs"), default=None, help="Parallel compile jobs (ninja default).")
@click.option("--force", is_flag=True, help="Rebuild even if the stamp matches.")
@click.option(
    "--targets", default=None, help="Comma-separated ninja targets instead of the default set (e.g. ggml-cuda)."
)
@click.option("--no-install", is_flag=True, help="Build only; do not pip-install llama-cpp-python.")
@click.option(
    "--rpc/--no-rpc",
    default=True,
    show_default=True,
    help="llama.cpp's RPC backend (GGML_RPC) and ggml-rpc-server, for --rpc offloading.",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Runtime dir (default $CLOVER_GGUF_RUNTIME_DIR or <cache>/runtime).",
)
@click.option(
    "--cmake-arg",
    "cmake_arg",
    multiple=True,
    help="Extra cmake argument (repeatable), e.g. -DCUDA_cublas_LIBRARY=/path/libcublas.so.13.",
)
def runtime_build_cmd(cuda, portable, cuda_arch, jobs, force, targets, no_install, rpc, root, cmake_arg):
    """Fetch the sdist, apply patches/*.patch, build once with cmake+ninja, install."""
    from .build import build_runtime

    build_runtime(
        cuda=cuda,
        cuda_archs=cuda_arch.replace(",", ";") if cuda_arch else None,
        jobs=jobs,
        force=force,
        targets=targets.split(",") if targets else None,
        install=not no_install,
        root=root,
        extra_cmake_args=cmake_arg,
        portable=portable,
        rpc=rpc,
    )


@runtime_group.command("paths")
def runtime_paths_cmd():
    """Print where the built runtime lives (lib_dir, bin_dir, stamp, ...)."""
    from .build import runtime_paths

    for k, v in runtime_paths().items():
        click.echo(f"{k:18s} {v}")
