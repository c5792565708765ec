#!/usr/bin/env bash
# The comparison sweep (docs/validation.md "The comparison sweep"): for each real model of the
# model set, calibrate on the first half of its text (split by documents), compile every method
# at ~2 bits, and validate on the other half under pseudo-decode.
#   gutenberg-27m: windows default (sink 64 / recent 256 / pages 64), small (4 / 32 / 32) and
#                  matched (4 / 128 / 128: KIVI's key token group and KVarN's tile are the
#                  128-token page, so KIVI-2 with 128-token key groups costs the same bits as the
#                  INT2 grids at G = 128; those rows, kivi128 and the mixed recipes kivi128-hadamard
#                  and kivi128-oscar, only run with pages of >= 128).
#   tinystories-656k, stories260k: small windows; the per-token grid methods use quantiser groups
#                  spanning KV heads (G = 64 and 32 channels: 4 heads of d = 16 / 8; 2.5 and 3
#                  bits per quantised element instead of 4 and 6 at G = head_dim).
#
#   scripts/sweep.sh [--kvcc PATH] [--out DIR] [--shared DIR] [--calib-tokens N] [--eval-docs N]
#                    [--eval-tokens N] [--models "a b"] [--windows "default small matched"] [--reuse]
#
# --shared: the model set, DIR/models/<model> and DIR/text/*.txt (default $KVCC_SHARED, else the
# location the tests use, KVCC_SHARED_DIR in tests/CMakeLists.txt).
# --eval-docs: validate on the first N held-out documents (0 = all; default 8 for gutenberg-27m,
# each cut at 2048 tokens, all 50 for the tiny models); whole documents, so no truncated tail
# document dilutes the means. --eval-tokens additionally caps the tokens (default 0 = no cap).
# --windows replaces every model's window list; --reuse keeps stats.h5 and artifacts already in
# the --out directory (re-validate without recalibrating; it assumes their compile options are
# unchanged). Output: OUT/<model>-<windows>.{json,svg,txt} (OUT: --out, default out/sweep); logs
# and artifacts in OUT/<model>/. With the defaults (65536 calibration tokens) the whole sweep took
# ~40 min on a shared 2-core machine, 28 of them gutenberg-27m's three validations
# (docs/results/2026-11-30-validation-sweep.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
shared="${KVCC_SHARED:-$root/../shared}"
kvcc="$root/build/cli/kvcc"
out="$root/out/sweep"  # out/ is git-ignored: results are data, never committed
calib_tokens=65536
eval_docs=""
eval_tokens=0
models="gutenberg-27m tinystories-656k stories260k"
windows_override=""
reuse=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kvcc) kvcc="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --shared) shared="$2"; shift 2 ;;
    --calib-tokens) calib_tokens="$2"; shift 2 ;;
    --eval-docs) eval_docs="$2"; shift 2 ;;
    --eval-tokens) eval_tokens="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --windows) windows_override="$2"; shift 2 ;;
    --reuse) reuse=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "sweep.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$kvcc" ]] || { echo "sweep.sh: no kvcc binary at $kvcc (use --kvcc)" >&2; exit 1; }
[[ -d "$shared/models" ]] || { echo "sweep.sh: $shared/models is missing (use --shared)" >&2; exit 1; }
mkdir -p "$out"

# Writes the first (half=1) or second (half=2) half of TEXT's documents to DEST, at most MAX of
# them (0: all).
split_half() {
  local text="$1" half="$2" dest="$3" max="${4:-0}"
  local n
  n=$(awk 'BEGIN{RS="<\\|endoftext\\|>"} NF>0{n++} END{print n}' "$text")
  awk -v half="$half" -v n="$n" -v max="$max" 'BEGIN{RS="<\\|endoftext\\|>"; ORS="<|endoftext|>"}
      NF>0 { i++; if ((half == 1 && i <= int(n/2)) || (half == 2 && i > int(n/2))) { k++; if (max == 0 || k <= max) print } }' \
      "$text" > "$dest.tmp" && mv "$dest.tmp" "$dest"
}

# compile LIST NAME ARGS...: one artifact into $work/NAME.kvcc.h5, appended to the array LIST.
compile() {
  local -n list="$1"
  local name="$2"; shift 2
  local file="$work/$name.kvcc.h5"
  if [[ $reuse == 1 && -f $file ]] || \
     "$kvcc" compile "$work/stats.h5" -o "$file" "$@" > "$work/$name.compile.log" 2>&1; then
    list+=(--artifact "$file")
  else
    echo "  compile $name failed: $(tail -1 "$work/$name.compile.log")" >&2
  fi
}

for model in $models; do
  grid_group=()  # --group for the per-token grid methods (identity, hadamard, oscar, oscar-lm)
  case "$model" in
    gutenberg-27m) text="$shared/text/gutenberg_heldout.txt"; mpath="$shared/models/gutenberg-27m"
                   windows="default small matched"; docs=8 ;;
    tinystories-656k) text="$shared/text/tinystories_valid_100.txt"; mpath="$shared/models/tinystories-656k"
                   windows="small"; docs=0; grid_group=(--group 64) ;;
    stories260k) text="$shared/text/tinystories_valid_100.txt"; mpath="$shared/models/stories260k/stories260K.bin"
                   windows="small"; docs=0; grid_group=(--group 32) ;;
    *) echo "sweep.sh: unknown model $model" >&2; exit 2 ;;
  esac
  [[ -n $windows_override ]] && windows="$windows_override"
  [[ -n $eval_docs ]] && docs="$eval_docs"
  work="$out/$model"
  mkdir -p "$work"
  split_half "$text" 1 "$work/calib.txt"
  split_half "$text" 2 "$work/heldout.txt" "$docs"
  if [[ $reuse == 1 && -f $work/stats.h5 ]]; then
    echo "== $model: reusing $work/stats.h5"
  else
    echo "== $model: calibrating on $work/calib.txt (<= $calib_tokens tokens)"
    "$kvcc" calibrate-model --model "$mpath" --data "$work/calib.txt" --tokens "$calib_tokens" \
        -o "$work/stats.h5" > "$work/calibrate.log" 2>&1
  fi
  # Compile once: windows are recorded in the recipe, but the fitted rotations and clip ratios do
  # not depend on them; each window setting is validated with validate's overrides.
  echo "== $model: compiling${grid_group[*]:+ (grid methods ${grid_group[*]})}"
  wargs=(--sink 64 --recent 256 --page-size 64)
  artifacts=() artifacts_p128=()
  compile artifacts identity -m identity "${grid_group[@]}" "${wargs[@]}"
  compile artifacts hadamard -m hadamard "${grid_group[@]}" "${wargs[@]}"
  compile artifacts kivi -m kivi "${wargs[@]}"
  compile artifacts kvarn -m kvarn "${wargs[@]}"
  compile artifacts turboquant2.5 -m turboquant --key-bits 2.5 --value-bits 2.5 "${wargs[@]}"
  compile artifacts turboquant3.5 -m turboquant --key-bits 3.5 --value-bits 3.5 "${wargs[@]}"
  for target in output p2 logit2; do
    compile artifacts "oscar-$target" -m oscar --value-target "$target" "${grid_group[@]}" "${wargs[@]}"
  done
  compile artifacts oscar-lm -m oscar-lm "${grid_group[@]}" "${wargs[@]}"
  compile artifacts commvq1 -m commvq --bits 1 "${wargs[@]}"
  compile artifacts commvq2 -m commvq --bits 2 "${wargs[@]}"
  # KIVI with 128-token key groups: 2.25 bits per element like the INT2 grids at G = 128. A key
  # group cannot span pages, so it only means that with pages of >= 128 tokens.
  if [[ " $windows " == *" matched "* ]]; then  # the only windows with pages of >= 128
    compile artifacts_p128 kivi128 -m kivi --group 128 "${wargs[@]}"
    # The mixed recipe: KIVI-128 keys + hadamard / oscar (p2) values, per-token grid with fitted clip.
    compile artifacts_p128 kivi128-hadamard -m kivi --group 128 --values hadamard "${wargs[@]}"
    compile artifacts_p128 kivi128-oscar -m kivi --group 128 --values oscar "${wargs[@]}"
  fi
  for win in $windows; do
    case "$win" in
      default) vargs=(--sink 64 --recent 256 --page-size 64); page=64 ;;
      small) vargs=(--sink 4 --recent 32 --page-size 32); page=32 ;;
      matched) vargs=(--sink 4 --recent 128 --page-size 128); page=128 ;;
      *) echo "sweep.sh: unknown windows $win (default | small | matched)" >&2; exit 2 ;;
    esac
    run=("${artifacts[@]}")
    (( page >= 128 )) && run+=("${artifacts_p128[@]}")
    echo "== $model ($win windows: ${vargs[*]}): validating $(( ${#run[@]} / 2 )) artifacts on ${docs/#0/all} held-out documents"
    "$kvcc" validate --model "$mpath" "${run[@]}" "${vargs[@]}" --data "$work/heldout.txt" \
        --tokens "$eval_tokens" --json "$out/$model-$win.json" --svg "$out/$model-$win.svg" \
        2> "$work/validate-$win.log" | tee "$out/$model-$win.txt"
  done
done
