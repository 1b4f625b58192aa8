#!/usr/bin/env bash
# Dev workflow for the Clover llama.cpp patches (patches/*.patch).
#
#   scripts/llama_dev.sh init DIR     unpack the llama-cpp-python sdist into DIR and turn
#                                     DIR/vendor/llama.cpp into a git repo (branch "clover",
#                                     tag "clover-base" = upstream 0c1e57098) with the series applied
#   scripts/llama_dev.sh export DIR   write the commits clover-base..HEAD of DIR/vendor/llama.cpp
#                                     back to patches/ (git format-patch, replaces patches/*.patch)
#   scripts/llama_dev.sh check        apply the series with `git apply` to a fresh unpack (temp dir)
#
# Patch paths are relative to vendor/llama.cpp (the llama.cpp tree inside the sdist).
# Environment: CLOVER_SDIST   path of llama_cpp_python-0.3.36.tar.gz
#                             (default: $CLOVER_CACHE/llama_cpp_python-0.3.36.tar.gz, CLOVER_CACHE
#                             defaulting to /work/cache; falls back to `pip download` if missing)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCHES="$HERE/patches"
SDIST_NAME="llama_cpp_python-0.3.36"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CACHE="${CLOVER_CACHE:-/work/cache}"
SDIST="${CLOVER_SDIST:-$CACHE/$SDIST_NAME.tar.gz}"

die() { echo "llama_dev.sh: $*" >&2; exit 1; }

fetch_sdist() {
    if [ ! -f "$SDIST" ]; then
        mkdir -p "$(dirname "$SDIST")"
        python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$(dirname "$SDIST")" >&2
    fi
    local got
    got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
    [ "$got" = "$SDIST_SHA256" ] || die "sha256 mismatch for $SDIST: $got"
}

unpack() { # DIR -> prints the vendor/llama.cpp path
    local dir="$1"
    mkdir -p "$dir"
    [ ! -e "$dir/$SDIST_NAME" ] || die "$dir/$SDIST_NAME already exists"
    tar -xzf "$SDIST" -C "$dir"
    echo "$dir/$SDIST_NAME/vendor/llama.cpp"
}

git_l() { git -c user.name="clover-gguf" -c user.email="clover-gguf@localhost" -c commit.gpgsign=false "$@"; }

cmd_init() {
    local dir="${1:?usage: llama_dev.sh init DIR}"
    fetch_sdist
    local v
    v="$(unpack "$dir")"
    cd "$v"
    # The sdist ships vendor/llama.cpp as a submodule checkout (.git file -> ../../.git/modules).
    # Use it when it works; otherwise make a fresh repository of the tree.
    if ! git rev-parse --verify -q HEAD >/dev/null 2>&1 || [ "$(git rev-parse --show-toplevel 2>/dev/null)" != "$(pwd -P)" ]; then
        rm -f .git
        git init -q
        git_l add -A -f .
        git_l commit -q -m "base: llama.cpp 0c1e57098 as vendored by llama-cpp-python 0.3.36"
    fi
    git_l checkout -q -B clover
    git_l tag -f clover-base >/dev/null
    shopt -s nullglob
    local series=("$PATCHES"/*.patch)
    if [ ${#series[@]} -gt 0 ]; then
        git_l am -q --whitespace=nowarn "${series[@]}"
    fi
    echo "ready: $v (branch clover, base tag clover-base, $(git rev-list --count clover-base..HEAD) patches applied)"
}

cmd_export() {
    local dir="${1:?usage: llama_dev.sh export DIR}"
    local v="$dir/$SDIST_NAME/vendor/llama.cpp"
    [ -d "$v" ] || v="$dir"   # also accept the vendor/llama.cpp path itself
    cd "$v"
    git rev-parse -q --verify clover-base >/dev/null || die "$v: no clover-base tag (run init first)"
    [ -z "$(git status --porcelain --untracked-files=no)" ] || die "$v: uncommitted changes; commit them first"
    mkdir -p "$PATCHES"
    rm -f "$PATCHES"/*.patch
    git format-patch -q --no-signature --zero-commit -N -o "$PATCHES" clover-base..HEAD
    ls -1 "$PATCHES"/*.patch
}

cmd_check() {
    fetch_sdist
    CHECK_TMP="$(mktemp -d)"
    trap 'rm -rf "$CHECK_TMP"' EXIT
    local tmp="$CHECK_TMP"
    tar -xzf "$SDIST" -C "$tmp"
    rm -rf "$tmp/$SDIST_NAME/.git" "$tmp/$SDIST_NAME/vendor/llama.cpp/.git"
    cd "$tmp/$SDIST_NAME/vendor/llama.cpp"
    local p
    for p in "$PATCHES"/*.patch; do   # one by one: a patch may change a file an earlier one creates
        git apply --check "$p" || die "$(basename "$p") does not apply"
        git apply "$p"
    done
    echo "OK: $(ls "$PATCHES"/*.patch | wc -l) patches apply cleanly to a fresh unpack"
}

case "${1:-}" in
    init)   shift; cmd_init "$@" ;;
    export) shift; cmd_export "$@" ;;
    check)  shift; cmd_check "$@" ;;
    *) sed -n '2,14p' "$0"; exit 1 ;;
esac
