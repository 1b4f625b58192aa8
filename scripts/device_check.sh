#!/usr/bin/env bash
# The one GPU check: build the CUDA runtime for the GPU present, run the ops Clover's graph uses
# through test-backend-ops (CUDA vs CPU), test-clover on CUDA, CUDA-vs-CPU parity (clover-tiny and
# a 1-layer full-width synthetic), the plan's GPU terms (matmul rates by type and rows, and
# llama.cpp's VRAM buffers against the plan's account), then speed at full depth (a 40-layer
# synthetic Clover-35B-A3B at q4_k_m, -ngl 99, and with exactly what a 16 GB card holds on the
# GPU), side by side with llama.cpp's own passes; optionally (split) that 16 GB placement timed
# with op offload from pageable and pinned memory and with --no-op-offload against the plan's
# prediction. Writes $OUT/summary.json (`clover-gguf plan --calibration summary.json` reads its
# "kernels") and $OUT/summary.md. Leaves nothing running.
#
#   scripts/device_check.sh --prepare        # here: pack what the GPU machine needs into .device/
#   scripts/device_check.sh                  # on the GPU machine (carry .device), ~8-11 minutes
#   scripts/device_check.sh --cpu-dry-run    # here: every step but the CUDA ones, small shapes
#
# The default stages may not fit one 10-minute call: run build,ops,correctness first, then
# --skip-build --stages kernels,memory,speed[,split] on the same (warm) machine.
#
# Options: --out DIR (default $OUT or out/device-check), --skip-build (reuse .device/build),
# --layers N (full-depth model, default 40),
# --stages LIST (build,ops,correctness,kernels,memory,speed; split is opt-in).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEV=$REPO/.device
MODE=gpu
STAGES=build,ops,correctness,kernels,memory,speed
LAYERS=40
OUTDIR=${OUT:-$REPO/out/device-check}
while [ $# -gt 0 ]; do
    case "$1" in
        --prepare) MODE=prepare ;;
        --cpu-dry-run) MODE=dry ;;
        --skip-build) STAGES=${STAGES/build,/} ;;
        --stages) STAGES=$2; shift ;;
        --layers) LAYERS=$2; shift ;;
        --out) OUTDIR=$2; shift ;;
        -h|--help) sed -n 2,23p "$0"; exit 0 ;;
        *) echo "device_check.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

log() { echo "[device-check $(date +%H:%M:%S)] $*" >&2; }

if [ "$MODE" = prepare ]; then
    # the patched llama.cpp tree (trimmed) and the pure-Python packages the GPU image lacks
    . .venv/bin/activate
    set -e
    SRC=$(python -c 'from clover_gguf.runtime.build import runtime_paths; print(runtime_paths()["src_dir"])')
    [ -d "$SRC/vendor/llama.cpp" ] || { echo "build the runtime first: clover-gguf runtime build" >&2; exit 1; }
    python -c 'from clover_gguf.runtime.build import patch_series, series_hash; print(series_hash(patch_series()))' > /tmp/series.now
    rm -rf "$DEV"; mkdir -p "$DEV/site"
    tar -C "$SRC/vendor" --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/benches \
        --exclude=llama.cpp/examples --exclude=llama.cpp/.git -czf "$DEV/llama-src.tar.gz" llama.cpp
    cp /tmp/series.now "$DEV/series.sha256"
    SITE=$(python -c 'import site; print(site.getsitepackages()[0])')
    for pkg in llama_cpp gguf diskcache; do cp -r "$SITE/$pkg" "$DEV/site/"; done
    rm -rf "$DEV"/site/llama_cpp/lib
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    du -sh "$DEV"
    exit 0
fi

mkdir -p "$OUTDIR"
T0=$(date +%s)
if [ "$MODE" = dry ]; then
    PY=$REPO/.venv/bin/python
    LAYERS=2
else
    PY=python3
    [ -f "$DEV/llama-src.tar.gz" ] || { echo "no .device/llama-src.tar.gz: run --prepare here and carry .device" >&2; exit 2; }
fi
export PYTHONPATH="$REPO:$DEV/site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = dry ]; then # the runtime this machine already built (ninja: nothing to redo)
    BUILD=$($PY -c 'from clover_gguf.runtime.build import runtime_paths; print(runtime_paths()["build_dir"])')
else
    BUILD=$DEV/build
fi
export LLAMA_CPP_LIB_PATH=$BUILD/bin
NPROC=$(nproc)
STATUS=0
record() { # name rc seconds
    echo "{\"stage\": \"$1\", \"rc\": $2, \"seconds\": $3}" >> "$OUTDIR/stages.jsonl"
    [ "$2" = 0 ] || STATUS=1
}
: > "$OUTDIR/stages.jsonl"
nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader > "$OUTDIR/gpu.txt" 2>/dev/null || echo none > "$OUTDIR/gpu.txt"
log "GPU: $(cat "$OUTDIR/gpu.txt"); mode $MODE; $NPROC cores"

# ---- build: the runtime for the GPU present, only the targets needed
# AMX left out of the native CPU kernels, as clover_gguf/runtime/build.py's NATIVE_CPU_FLAGS
CPU_FLAGS="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
if [[ $STAGES == *build* ]]; then
    t=$(date +%s)
    if [ "$MODE" = dry ]; then
        ninja -C "$BUILD" llama ggml test-backend-ops test-clover llama-clover-cli > "$OUTDIR/build.log" 2>&1
    else
        rm -rf "$DEV/src" && mkdir -p "$DEV/src" && tar -C "$DEV/src" -xzf "$DEV/llama-src.tar.gz"
        ARCH=$(head -1 "$OUTDIR/gpu.txt" | awk -F', ' '{gsub(/\./, "", $3); print $3}')
        cmake -S "$REPO/native" -DLLAMA_CPP_DIR="$DEV/src/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
            -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$CPU_FLAGS" "-DCMAKE_CXX_FLAGS=$CPU_FLAGS" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${ARCH:-90}" -DGGML_CUDA_FA=OFF \
            -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
            -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' > "$OUTDIR/build.log" 2>&1 \
          && ninja -C "$BUILD" -j "$NPROC" llama ggml ggml-cuda test-backend-ops test-clover llama-clover-cli \
               >> "$OUTDIR/build.log" 2>&1
    fi
    rc=$?
    record build $rc $(( $(date +%s) - t ))
    log "build rc=$rc in $(( $(date +%s) - t )) s"
    [ $rc = 0 ] || { tail -30 "$OUTDIR/build.log" >&2; exit 1; }
fi

# ---- ops: test-backend-ops for every op Clover's graph uses (CUDA vs CPU; CPU alone: crash/NaN check)
if [[ $STAGES == *ops* ]]; then
    t=$(date +%s)
    B=CUDA0; [ "$MODE" = dry ] && B=CPU
    : > "$OUTDIR/ops.txt"
    for op in GATED_DELTA_NET GUMBEL_ARGMAX SSM_CONV MUL_MAT_ID MUL_MAT GET_ROWS RMS_NORM ROPE SOFT_MAX CONCAT PAD \
              SUM_ROWS SET CPY CONT SCALE ADD MUL SILU SIGMOID SOFTPLUS SWIGLU ARGSORT TOP_K; do
        # upstream's full MUL_MAT(_ID) lists take minutes: keep the types Clover's recipes use and,
        # for MUL_MAT_ID, Clover-35B-A3B's 256-expert shapes
        P=()
        [ $op = MUL_MAT ] && P=(-p 'type_a=(f32|f16|bf16|q8_0|q6_K|q5_K|q4_K|iq4_xs),type_b=f32')
        [ $op = MUL_MAT_ID ] && P=(-p 'n_mats=256')
        timeout 300 "$BUILD/bin/test-backend-ops" test -b $B -o $op "${P[@]}" > "$OUTDIR/ops-$op.log" 2>&1
        rc=$?
        echo "$op rc=$rc $(grep -c 'OK' "$OUTDIR/ops-$op.log") OK, $(grep -c 'FAIL' "$OUTDIR/ops-$op.log") FAIL" >> "$OUTDIR/ops.txt"
        [ $rc = 0 ] || STATUS=1
    done
    record ops 0 $(( $(date +%s) - t ))
    log "ops: $(grep -c 'rc=0' "$OUTDIR/ops.txt") of $(wc -l < "$OUTDIR/ops.txt") passed"
fi

# ---- correctness: test-clover on the backend, CUDA-vs-CPU parity
if [[ $STAGES == *correctness* ]]; then
    t=$(date +%s)
    $PY -m clover_gguf.cli convert tests/data/spec-vectors/random-clover -o "$OUTDIR/random-clover-f32.gguf" \
        --recipe f32 --force -q > /dev/null 2>&1
    timeout 300 "$BUILD/bin/test-clover" "$OUTDIR/random-clover-f32.gguf" tests/data/spec-vectors/vectors.json \
        > "$OUTDIR/test-clover.log" 2>&1
    rc=$?
    record test-clover $rc $(( $(date +%s) - t ))
    log "test-clover rc=$rc ($(tail -1 "$OUTDIR/test-clover.log"))"
    t=$(date +%s)
    timeout 400 $PY scripts/device_check.py parity --out "$OUTDIR" --mode "$MODE" 2> "$OUTDIR/parity.log"
    rc=$?
    record parity $rc $(( $(date +%s) - t ))
    log "parity rc=$rc"
fi

# ---- the plan's GPU terms: matmul rates by type and rows, llama.cpp's VRAM buffers
if [[ $STAGES == *kernels* ]]; then
    t=$(date +%s)
    if [ "$MODE" = dry ]; then
        GGML_H=$($PY -c 'from clover_gguf.runtime.build import runtime_paths; print(runtime_paths()["src_dir"])')/vendor/llama.cpp/ggml/include/ggml.h
    else
        GGML_H=$DEV/src/llama.cpp/ggml/include/ggml.h
    fi
    timeout 400 $PY scripts/device_check.py kernels --out "$OUTDIR" --mode "$MODE" --bin "$BUILD/bin" \
        --ggml-h "$GGML_H" 2> "$OUTDIR/kernels.log"
    rc=$?
    record kernels $rc $(( $(date +%s) - t ))
    log "kernels rc=$rc"
fi
if [[ $STAGES == *memory* ]]; then
    t=$(date +%s)
    timeout 300 $PY scripts/device_check.py memory --out "$OUTDIR" --mode "$MODE" --layers "$LAYERS" \
        2> "$OUTDIR/memory.log"
    rc=$?
    record memory $rc $(( $(date +%s) - t ))
    log "memory rc=$rc"
fi

# ---- speed at full depth, and the 16 GB placement
if [[ $STAGES == *speed* ]]; then
    t=$(date +%s)
    timeout 560 $PY scripts/device_check.py speed --out "$OUTDIR" --mode "$MODE" --layers "$LAYERS" \
        --threads "$([ "$MODE" = dry ] && echo 2 || echo "$NPROC")" 2> "$OUTDIR/speed.log"
    rc=$?
    record speed $rc $(( $(date +%s) - t ))
    log "speed rc=$rc"
fi

# ---- opt-in: the 16 GB placement with each way of treating host experts, against the plan
if [[ $STAGES == *split* ]]; then
    t=$(date +%s)
    timeout 400 $PY scripts/device_check.py split --out "$OUTDIR" --mode "$MODE" --layers "$LAYERS" \
        --threads "$([ "$MODE" = dry ] && echo 2 || echo "$NPROC")" 2> "$OUTDIR/split.log"
    rc=$?
    record split $rc $(( $(date +%s) - t ))
    log "split rc=$rc"
fi

$PY scripts/device_check.py summary --out "$OUTDIR" --mode "$MODE" --seconds $(( $(date +%s) - T0 ))
log "done in $(( $(date +%s) - T0 )) s: $OUTDIR/summary.md"
exit $STATUS
