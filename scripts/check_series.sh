#!/usr/bin/env bash
# Build llama.cpp after each patch of patches/ and run the tests that exist at that point.
#
#   scripts/check_series.sh [--out DIR] [--work DIR]
#
# The committed patch files are applied one by one to a fresh unpack of the runtime's sdist
# (`clover_gguf.runtime.build.fetch_sdist`: $CLOVER_GGUF_SDIST if set, else the cache); after each,
# one build tree (incremental, ccache when installed) builds the CPU targets that exist, then runs:
#   quantize   llama-quantize of clover-tiny F32 -> experts Q4_K, attn_q Q4_K, the rest Q8_0 (ssm_alpha/beta
#              F32, as our converter keeps them), tensor for tensor equal to `clover-gguf convert` with
#              those types                                          (once the arch exists)
#   vectors    test-clover on the spec's vectors (F32 GGUF)        (once test-clover exists)
#   generate   llama-clover-cli, 32 greedy tokens of clover-tiny Q4_K_M; every prefix that has
#              the CLI must print the same ids                     (once the CLI exists)
#   upstream   convert_hf_to_gguf.py on clover-tiny: the same tensors and keys as ours
#                                                                   (once gguf-py knows clover)
# test-backend-ops is built at every prefix but compares a backend against the CPU, so on a
# CPU-only machine it checks nothing: scripts/device_check.sh runs it on a GPU.
#
# Writes DIR/log.txt (every command's tail on failure) and DIR/summary.md, which names the series'
# hash (tests/runtime/test_patches.py checks that it is the committed series'); exits non-zero when a
# prefix fails to apply, build or pass. Default DIR: evaldata/series.
# Environment: PYTHON (default .venv/bin/python, else python3).
#
#   bash scripts/check_series.sh                         # before committing a change to patches/
#   CCACHE_DISABLE=1 bash scripts/check_series.sh        # from nothing (about 15 minutes on 2 cores)
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$HERE/evaldata/series"
WORK=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        *) sed -n '2,26p' "$0"; exit 2 ;;
    esac
done
PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x "$HERE/.venv/bin/python" ] && PY="$HERE/.venv/bin/python" || PY=python3; }
[ -n "$WORK" ] || WORK="$(mktemp -d)"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"
SUM="$OUT/summary.md"
: > "$LOG"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# ---- inputs, made by this checkout's converter (every run: a converter change must show here)
IN="$WORK/inputs"
mkdir -p "$IN"
conv() { # SRC NAME ARGS...
    local src="$1" name="$2"
    shift 2
    "$PY" -m clover_gguf.cli convert "$src" -o "$IN/$name" --force "$@" -q >> "$LOG" 2>&1
}
conv "$HERE/tests/data/spec-vectors/random-clover" vec-f32.gguf --recipe f32 \
    && conv "$HERE/models/clover-tiny" tiny-f32.gguf --recipe f32 \
    && conv "$HERE/models/clover-tiny" tiny-bf16.gguf --recipe bf16 \
    && conv "$HERE/models/clover-tiny" tiny-q4km.gguf --recipe q4_k_m \
    && conv "$HERE/models/clover-tiny" tiny-q8-q4k.gguf --outtype q8_0 --experts q4_k --tensor-type attn_q=q4_k \
    || { log "could not convert the test inputs (see above)"; exit 2; }

# ---- a fresh unpack and build tree (the unpack keeps the archive's file times, so an older build
# tree would look current); the patches go on one by one with `git apply`
SDIST="$("$PY" -c 'from clover_gguf.runtime.build import fetch_sdist; print(fetch_sdist())')" \
    || { log "could not fetch the llama-cpp-python sdist"; exit 2; }
SDIST_NAME="$(basename "$SDIST" .tar.gz)"
SRC="$WORK/$SDIST_NAME/vendor/llama.cpp"
BUILD="$WORK/build"
rm -rf "$WORK/$SDIST_NAME" "$BUILD"
tar -xzf "$SDIST" -C "$WORK"
rm -rf "$WORK/$SDIST_NAME/.git" "$SRC/.git"
LAUNCH=()
command -v ccache > /dev/null && LAUNCH=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

# the native build's CPU flags, as the runtime builds it (AMX left out: clover_gguf/runtime/build.py)
CPU_FLAGS="$("$PY" -c 'from clover_gguf.runtime.build import NATIVE_CPU_FLAGS; print(NATIVE_CPU_FLAGS)')"

PATCHES=("$HERE"/patches/*.patch)
series_hash() { "$PY" -c 'from clover_gguf.runtime.build import patch_series, series_hash; print(series_hash(patch_series()))'; }
SERIES="$(series_hash)"
echo "| # | patch | apply | build (s) | quantize | vectors | generate | upstream |" > "$SUM"
echo "|---|---|---|---|---|---|---|---|" >> "$SUM"
FAILED=0
IDS_FIRST=""

# run NAME CMD...: a test; its output goes to the log, its verdict to $R
run() {
    local name="$1"; shift
    local t0=$SECONDS out
    out="$("$@" 2>&1)"
    local rc=$?
    if [ $rc = 0 ]; then R="ok"; else R="FAIL"; FAILED=1; fi
    log "  $name: $R ($((SECONDS - t0)) s)"
    [ $rc = 0 ] || echo "$out" | tail -30 >> "$LOG"
    LAST_OUT="$out"
}

same_tensors() { # A B: same tensor names, types, shapes and bytes (llama-quantize writes [n, 1] as [n])
    "$PY" - "$1" "$2" << 'EOF'
import sys
from gguf import GGUFReader
def shape(x):
    s = [int(n) for n in x.shape]
    while len(s) > 1 and s[-1] == 1:
        s.pop()
    return tuple(s)
def t(p):
    return {x.name: (x.tensor_type.name, shape(x), x.data.tobytes()) for x in GGUFReader(p).tensors}
a, b = t(sys.argv[1]), t(sys.argv[2])
bad = sorted(set(a) ^ set(b)) + [n for n in a if n in b and a[n] != b[n]]
print(f"{len(a)} tensors, {len(bad)} differ" + (f": {bad[:5]}" if bad else ""))
sys.exit(1 if bad else 0)
EOF
}

same_keys() { # A B: the same clover.* / tokenizer.* keys and values
    "$PY" - "$1" "$2" << 'EOF'
import sys
from gguf import GGUFReader
def kv(p):
    return {k: (tuple(f.types), f.contents()) for k, f in GGUFReader(p).fields.items()
            if k.startswith(("clover.", "tokenizer.")) or k == "general.architecture"}
a, b = kv(sys.argv[1]), kv(sys.argv[2])
bad = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
print(f"{len(a)} keys, {len(bad)} differ" + (f": {bad[:5]}" if bad else ""))
sys.exit(1 if bad else 0)
EOF
}

upstream_convert() {
    # upstream's converter with the gguf-py of the tree under test
    env -u NO_LOCAL_GGUF PYTHONPATH="$SRC/gguf-py" "$PY" "$SRC/convert_hf_to_gguf.py" "$HERE/models/clover-tiny" \
        --outtype bf16 --outfile "$WORK/upstream-bf16.gguf" > /dev/null \
        && same_keys "$IN/tiny-bf16.gguf" "$WORK/upstream-bf16.gguf" \
        && same_tensors "$IN/tiny-bf16.gguf" "$WORK/upstream-bf16.gguf"
}

quantize_check() { # the types of tests/convert/test_llama_quantize.py
    local t=()
    for p in gate up down; do t+=(--tensor-type "ffn_${p}_exps=q4_k"); done
    "$BUILD/bin/llama-quantize" --pure "${t[@]}" --tensor-type attn_q=q4_k --tensor-type ssm_alpha=f32 --tensor-type ssm_beta=f32 \
        "$IN/tiny-f32.gguf" "$WORK/quant.gguf" Q8_0 \
        > /dev/null && same_tensors "$IN/tiny-q8-q4k.gguf" "$WORK/quant.gguf"
}

vectors_check() {
    "$BUILD/bin/test-clover" "$IN/vec-f32.gguf" "$HERE/tests/data/spec-vectors/vectors.json" | grep 'ALL OK'
}

generate() {
    "$BUILD/bin/llama-clover-cli" -m "$IN/tiny-q4km.gguf" -p "def fibonacci(n):" -n 32 -t 2 --verbose-prompt 2> /dev/null \
        | tail -1 | grep '^ids: '
}

k=0
for p in "${PATCHES[@]}"; do
    k=$((k + 1))
    name="$(basename "$p" .patch)"
    if ! (cd "$SRC" && git apply "$p") >> "$LOG" 2>&1; then
        log "$name: does not apply"
        echo "| $k | $name | FAIL | | | | | |" >> "$SUM"
        FAILED=1
        break
    fi
    log "$name"
    targets=(ggml llama test-backend-ops llama-quantize)
    [ -f "$SRC/tests/test-clover.cpp" ] && targets+=(test-clover)
    [ -f "$SRC/tools/clover-cli/clover-cli.cpp" ] && targets+=(llama-clover-cli)
    t0=$SECONDS
    if cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
        "-DCMAKE_C_FLAGS=$CPU_FLAGS" "-DCMAKE_CXX_FLAGS=$CPU_FLAGS" -DGGML_CCACHE=OFF "${LAUNCH[@]}" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_CLOVER=ON -DGGML_CUDA=OFF > "$WORK/build.log" 2>&1 \
        && ninja -C "$BUILD" "${targets[@]}" >> "$WORK/build.log" 2>&1; then
        build="$((SECONDS - t0))"
        log "  build ${targets[*]}: ok ($build s)"
    else
        build="FAIL"
        FAILED=1
        log "  build ${targets[*]}: FAIL"
        grep -E "error|Error" "$WORK/build.log" | head -20 >> "$LOG"
        echo "| $k | $name | ok | FAIL | | | | |" >> "$SUM"
        continue
    fi
    q="–" v="–" g="–" u="–"
    if [ -f "$SRC/src/models/clover.cpp" ]; then
        run quantize quantize_check
        q="$R"
    fi
    if [[ " ${targets[*]} " == *" test-clover "* ]]; then
        run vectors vectors_check
        v="$R"
    fi
    if [[ " ${targets[*]} " == *" llama-clover-cli "* ]]; then
        run generate generate
        g="$R"
        ids="$LAST_OUT"
        if [ "$R" = ok ]; then
            [ -n "$IDS_FIRST" ] || IDS_FIRST="$ids"
            if [ "$ids" != "$IDS_FIRST" ]; then g="FAIL (other ids)"; FAILED=1; log "  generate: other ids: $ids"; fi
        fi
    fi
    if [ -f "$SRC/conversion/clover.py" ]; then
        run upstream upstream_convert
        u="$R"
    fi
    echo "| $k | $name | ok | $build | $q | $v | $g | $u |" >> "$SUM"
done

[ "$(series_hash)" = "$SERIES" ] || { log "patches/ changed during the run: run it again"; FAILED=1; SERIES="changed during the run"; }
{
    echo
    echo "series: \`$SERIES\` ($k patches)"
    echo
    echo "ids of every prefix with llama-clover-cli: \`${IDS_FIRST:-none}\`"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, ccache: $(command -v ccache > /dev/null && [ -z "${CCACHE_DISABLE:-}" ] && echo yes || echo no)."
    echo "build (s): the incremental build after that patch (CMake's dependencies decide what recompiles)."
} >> "$SUM"
log "done: $([ $FAILED = 0 ] && echo 'every prefix builds and passes' || echo 'FAILURES, see above')"
exit $FAILED
