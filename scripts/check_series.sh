#!/usr/bin/env bash
# Build llama.cpp after each patch of patches/ and run the tests that exist at that point.
#
#   scripts/check_series.sh [--out DIR] [--work DIR]
#
# The committed patch files are applied one by one to a fresh unpack of the runtime's sdist
# (`clover_gguf.runtime.build.fetch_sdist`: $CLOVER_GGUF_SDIST if set, else the cache). One build tree
# (incremental, ccache when installed; the project's native/ with llama.cpp as its subdirectory)
# builds the base first, then after each patch the CPU targets that exist, and runs:
#   unit       upstream's test-alloc and test-gguf (no model needed)
#   symbols    the C symbols the series has added so far to libggml*, libllama and libllama-common
#              against the base's build (scripts/series_symbols.py; mangled C++ internals apart)
#   quantize   llama-quantize of clover-tiny F32 -> experts Q4_K, attn_q Q4_K, the rest Q8_0 (ssm_alpha/beta
#              F32, as our converter keeps them), tensor for tensor equal to `clover-gguf convert` with
#              those types                                          (once the arch exists)
#   diffusion  llama-diffusion-cli, 32 greedy tokens of clover-tiny Q4_K_M (block commit)
#                                                                   (once examples/diffusion has it)
#   upstream   convert_hf_to_gguf.py on clover-tiny: the same tensors and keys as ours
#                                                                   (once gguf-py knows clover)
# After the last patch, clover-gguf's own native/ (libclover, test-clover, llama-clover-cli) is built
# on the series: test-clover on the spec's vectors, and llama-clover-cli must print the same ids as
# llama-diffusion-cli for the same prompt ids.
# test-backend-ops is built at every prefix but compares a backend against the CPU, so on a
# CPU-only machine it checks nothing: scripts/device_check.sh runs it on a GPU.
#
# Writes DIR/log.txt (every command's tail on failure) and DIR/summary.md, which names the series'
# hash (tests/runtime/test_patches.py checks that it is the committed series'); exits non-zero when a
# prefix fails to apply, build or pass. Default DIR: evaldata/series.
# Environment: PYTHON (default .venv/bin/python, else python3); SAMPLER_MODEL, a non-clover GGUF:
# upstream's test-backend-sampler runs case by case on it, on the base and after the whole series.
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
echo "| # | patch | apply | build (s) | C symbols added | test-alloc, test-gguf | quantize | diffusion | upstream |" > "$SUM"
echo "|---|---|---|---|---|---|---|---|---|" >> "$SUM"
FAILED=0
IDS=""
PROMPT_IDS=""

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

unit_tests() { # upstream's own harnesses that need no model: test-alloc (0003's case), test-gguf (0005's)
    "$BUILD/bin/test-alloc" > "$WORK/test-alloc.log" 2>&1 || { tail -5 "$WORK/test-alloc.log"; return 1; }
    "$BUILD/bin/test-gguf" > "$WORK/test-gguf.log" 2>&1 || { tail -5 "$WORK/test-gguf.log"; return 1; }
}

sampler_tests() { # TAG: upstream's test-backend-sampler, case by case, on $SAMPLER_MODEL (a non-clover GGUF)
    local t line="- $1:"
    for t in $("$PY" -c 'import re, sys; print(" ".join(re.findall(r"\{ \"(\w+)\",\s+test_backend_", open(sys.argv[1]).read())))' "$SRC/tests/test-backend-sampler.cpp"); do
        if timeout 600 "$BUILD/bin/test-backend-sampler" --test "$t" --model "$SAMPLER_MODEL" > "$WORK/sampler-$t.log" 2>&1; then
            line="$line $t ok,"
        else
            line="$line **$t FAIL**,"
        fi
    done
    echo "$line" >> "$WORK/sampler.md"
}

vectors_check() {
    "$BUILD/bin/test-clover" "$IN/vec-f32.gguf" "$HERE/tests/data/spec-vectors/vectors.json" | grep 'ALL OK'
}

diffusion_ids() { # llama-diffusion-cli's greedy ids, and the prompt's
    local out
    out="$("$BUILD/bin/llama-diffusion-cli" -m "$IN/tiny-q4km.gguf" -p "def fibonacci(n):" -n 32 -t 2 --temp 0 \
        --diffusion-threshold 0 --diffusion-steps 8 --verbose-prompt 2>&1)" || { echo "$out" | tail -5; return 1; }
    echo "$out" | grep -o 'prompt ids: .*' | tail -1
    echo "$out" | grep -o ' ids: .*' | sed 's/^ //' | tail -1 | grep '^ids: '
}

clover_cli_ids() { # llama-clover-cli (native/) on the same prompt ids: the same ids as llama-diffusion-cli
    local ids
    ids="$("$BUILD/bin/llama-clover-cli" -m "$IN/tiny-q4km.gguf" --prompt-ids "$PROMPT_IDS" -n 32 -t 2 \
        --diffusion-threshold 0 --diffusion-steps 8 --verbose-prompt 2> /dev/null | grep '^ids: ')" || return 1
    echo "$ids"
    [ "$ids" = "$IDS" ] || { echo "llama-diffusion-cli: $IDS"; return 1; }
}

configure() {
    cmake -S "$HERE/native" -DLLAMA_CPP_DIR="$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$CPU_FLAGS" "-DCMAKE_CXX_FLAGS=$CPU_FLAGS" -DGGML_CCACHE=OFF "${LAUNCH[@]}" \
        -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_CUDA=OFF > "$WORK/build.log" 2>&1
}

LIBS=(ggml ggml-base ggml-cpu llama llama-common)
t0=$SECONDS
if configure && ninja -C "$BUILD" "${LIBS[@]}" >> "$WORK/build.log" 2>&1; then
    rm -rf "$WORK/base-lib" && mkdir -p "$WORK/base-lib" && cp -a "$BUILD"/bin/lib*.so* "$WORK/base-lib/"
    : > "$WORK/sampler.md"
    if [ -n "${SAMPLER_MODEL:-}" ] && ninja -C "$BUILD" test-backend-sampler >> "$WORK/build.log" 2>&1; then
        sampler_tests base
    fi
    log "base: build ${LIBS[*]}: ok ($((SECONDS - t0)) s)"
    echo "| 0 | base (0c1e57098) | | $((SECONDS - t0)) | | | | | |" >> "$SUM"
else
    log "base: build FAIL"; grep -E "error|Error" "$WORK/build.log" | head -20 >> "$LOG"; exit 2
fi

k=0
for p in "${PATCHES[@]}"; do
    k=$((k + 1))
    name="$(basename "$p" .patch)"
    if ! (cd "$SRC" && git apply "$p") >> "$LOG" 2>&1; then
        log "$name: does not apply"
        echo "| $k | $name | FAIL | | | | | | |" >> "$SUM"
        FAILED=1
        break
    fi
    log "$name"
    targets=("${LIBS[@]}" test-backend-ops llama-quantize test-alloc test-gguf)
    grep -q block_commit "$SRC/examples/diffusion/diffusion.h" && targets+=(llama-diffusion-cli)
    t0=$SECONDS
    if configure && ninja -C "$BUILD" "${targets[@]}" >> "$WORK/build.log" 2>&1; then
        build="$((SECONDS - t0))"
        log "  build ${targets[*]}: ok ($build s)"
    else
        build="FAIL"
        FAILED=1
        log "  build ${targets[*]}: FAIL"
        grep -E "error|Error" "$WORK/build.log" | head -20 >> "$LOG"
        echo "| $k | $name | ok | FAIL | | | | | |" >> "$SUM"
        continue
    fi
    "$PY" "$HERE/scripts/series_symbols.py" "$WORK/base-lib" "$BUILD/bin" --json "$WORK/symbols.json" > "$WORK/symbols.txt"
    sym="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["c_added"])' "$WORK/symbols.json")"
    log "  C symbols added so far: $sym"
    q="–" g="–" u="–"
    run upstream-tests unit_tests
    t="$R"
    if [ -f "$SRC/src/models/clover.cpp" ]; then
        run quantize quantize_check
        q="$R"
    fi
    if [[ " ${targets[*]} " == *" llama-diffusion-cli "* ]]; then
        run diffusion diffusion_ids
        g="$R"
        IDS="$(echo "$LAST_OUT" | grep '^ids: ')"
        PROMPT_IDS="$(echo "$LAST_OUT" | grep '^prompt ids: ' | sed 's/prompt ids: //; s/ /,/g')"
    fi
    if [ -f "$SRC/conversion/clover.py" ]; then
        run upstream upstream_convert
        u="$R"
    fi
    echo "| $k | $name | ok | $build | $sym | $t | $q | $g | $u |" >> "$SUM"
done

if [ -n "${SAMPLER_MODEL:-}" ] && ninja -C "$BUILD" test-backend-sampler >> "$WORK/build.log" 2>&1; then
    sampler_tests "series ($k patches)"
fi

# clover-gguf's native side on the whole series
t0=$SECONDS
v="–" c="–"
if ninja -C "$BUILD" clover clover-grammar test-clover llama-clover-cli >> "$WORK/build.log" 2>&1; then
    nb="$((SECONDS - t0))"
    log "native: build ok ($nb s)"
    run vectors vectors_check
    v="$R"
    if [ -n "$IDS" ]; then
        run clover-cli clover_cli_ids
        c="$R"
    fi
else
    nb="FAIL"; FAILED=1; log "native: build FAIL"; grep -E "error|Error" "$WORK/build.log" | head -20 >> "$LOG"
fi
{
    echo
    echo "native/ (clover-gguf's libclover, test-clover, llama-clover-cli) on the whole series: build $nb s," \
        "test-clover vectors $v, llama-clover-cli ids = llama-diffusion-cli ids $c"
    echo
    if [ -s "$WORK/sampler.md" ]; then
        echo "test-backend-sampler on \`$(basename "$SAMPLER_MODEL")\` (SAMPLER_MODEL), each case, base and whole series:"
        echo
        cat "$WORK/sampler.md"
        echo
    fi
    echo "C symbols the series adds (scripts/series_symbols.py, against the base's build):"
    echo
    echo '```'
    cat "$WORK/symbols.txt"
    echo '```'
} >> "$SUM"

[ "$(series_hash)" = "$SERIES" ] || { log "patches/ changed during the run: run it again"; FAILED=1; SERIES="changed during the run"; }
{
    echo
    echo "series: \`$SERIES\` ($k patches)"
    echo
    echo "llama-diffusion-cli's greedy ids (prompt ids \`${PROMPT_IDS:-none}\`): \`${IDS:-none}\`"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, ccache: $(command -v ccache > /dev/null && [ -z "${CCACHE_DISABLE:-}" ] && echo yes || echo no)."
    echo "build (s): the incremental build after that patch (CMake's dependencies decide what recompiles)."
} >> "$SUM"
log "done: $([ $FAILED = 0 ] && echo 'every prefix builds and passes' || echo 'FAILURES, see above')"
exit $FAILED
