#!/usr/bin/env bash
# The comparison sweep (docs/validation.md): for each real model in ../shared/models, calibrate on
# the first half of its text (split by documents), compile every method at ~2 bits, and validate
# on the other half under pseudo-decode. gutenberg-27m runs with the default windows (sink 64 /
# recent 256) and small ones (4 / 32); the tiny models with the small windows.
#
#   scripts/sweep.sh [--kvcc PATH] [--out DIR] [--calib-tokens N] [--eval-tokens N] [--models "a b"]
#
# Token caps keep it to ~20 minutes on 2 cores. Results: DIR/<model>-<windows>.{json,svg,txt}.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
shared="$root/../shared"
kvcc="$root/build/cli/kvcc"
out="$root/sweep-out"
calib_tokens=32768
eval_tokens=16384
models="gutenberg-27m tinystories-656k stories260k"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kvcc) kvcc="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --calib-tokens) calib_tokens="$2"; shift 2 ;;
    --eval-tokens) eval_tokens="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    *) echo "sweep.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$kvcc" ]] || { echo "sweep.sh: no kvcc binary at $kvcc (use --kvcc)" >&2; exit 1; }
[[ -d "$shared/models" ]] || { echo "sweep.sh: $shared/models is missing" >&2; exit 1; }
mkdir -p "$out"

# Writes the first (half=1) or second (half=2) half of TEXT's documents to OUT.
split_half() {
  local text="$1" half="$2" dest="$3"
  local n
  n=$(awk 'BEGIN{RS="<\\|endoftext\\|>"} NF>0{n++} END{print n}' "$text")
  awk -v half="$half" -v n="$n" 'BEGIN{RS="<\\|endoftext\\|>"; ORS="<|endoftext|>"}
      NF>0 { i++; if ((half == 1 && i <= int(n/2)) || (half == 2 && i > int(n/2))) print }' \
      "$text" > "$dest.tmp" && mv "$dest.tmp" "$dest"
}

# compile NAME ARGS...: one artifact into $work/NAME.kvcc.h5
compile() {
  local name="$1"; shift
  if "$kvcc" compile "$work/stats.h5" -o "$work/$name.kvcc.h5" "$@" > "$work/$name.compile.log" 2>&1; then
    artifacts+=(--artifact "$work/$name.kvcc.h5")
  else
    echo "  compile $name failed: $(tail -1 "$work/$name.compile.log")" >&2
  fi
}

for model in $models; do
  case "$model" in
    gutenberg-27m) text="$shared/text/gutenberg_heldout.txt"; mpath="$shared/models/gutenberg-27m"
                   windows="default small" ;;
    tinystories-656k) text="$shared/text/tinystories_valid_100.txt"; mpath="$shared/models/tinystories-656k"
                   windows="small" ;;
    stories260k) text="$shared/text/tinystories_valid_100.txt"; mpath="$shared/models/stories260k/stories260K.bin"
                   windows="small" ;;
    *) echo "sweep.sh: unknown model $model" >&2; exit 2 ;;
  esac
  work="$out/$model"
  mkdir -p "$work"
  split_half "$text" 1 "$work/calib.txt"
  split_half "$text" 2 "$work/heldout.txt"
  echo "== $model: calibrating on $work/calib.txt (<= $calib_tokens tokens)"
  "$kvcc" calibrate-model --model "$mpath" --data "$work/calib.txt" --tokens "$calib_tokens" \
      -o "$work/stats.h5" > "$work/calibrate.log" 2>&1
  # Compile once (windows are recorded in the recipe but the fitted rotations and clip ratios do
  # not depend on them); each window setting is then validated with validate's overrides.
  wargs=(--sink 64 --recent 256 --page-size 64)
  artifacts=()
  compile identity -m identity "${wargs[@]}"
  compile hadamard -m hadamard "${wargs[@]}"
  compile kivi -m kivi "${wargs[@]}"
  compile kvarn -m kvarn "${wargs[@]}"
  compile turboquant2.5 -m turboquant --key-bits 2.5 --value-bits 2.5 "${wargs[@]}"
  compile turboquant3.5 -m turboquant --key-bits 3.5 --value-bits 3.5 "${wargs[@]}"
  for target in output p2 logit2; do
    compile "oscar-$target" -m oscar --value-target "$target" "${wargs[@]}"
  done
  compile oscar-lm -m oscar-lm "${wargs[@]}"
  if "$kvcc" compile --help 2>/dev/null | grep -q commvq; then
    compile commvq1 -m commvq --key-bits 1 --value-bits 1 "${wargs[@]}"
    compile commvq2 -m commvq --key-bits 2 --value-bits 2 "${wargs[@]}"
  fi
  for win in $windows; do
    if [[ $win == default ]]; then vargs=(--sink 64 --recent 256 --page-size 64)
    else vargs=(--sink 4 --recent 32 --page-size 32); fi
    echo "== $model ($win windows): validating $(( ${#artifacts[@]} / 2 )) artifacts on <= $eval_tokens held-out tokens"
    "$kvcc" validate --model "$mpath" "${artifacts[@]}" "${vargs[@]}" --data "$work/heldout.txt" \
        --tokens "$eval_tokens" --json "$out/$model-$win.json" --svg "$out/$model-$win.svg" \
        2> "$work/validate-$win.log" | tee "$out/$model-$win.txt"
  done
done
