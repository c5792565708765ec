#!/usr/bin/env bash
# Rebuilds the project's own zoo (zoo/published): for each model in ../shared/models, calibrate on
# the first half of its text, compile OSCAR INT2 and the best other 2-bit recipe (the non-OSCAR
# method with the lowest held-out attention-output error in `kvcc report`), and publish both with
# the report's numbers in the card. Needs a built kvcc and python3 (to split the text and read the
# report JSON). Both artifacts are then validated with `kvcc validate` on the second (held-out) half of
# the text (small windows: sink 4 / recent 32 / pages of 32; gutenberg-27m capped at 4096 tokens) and
# published with that report attached (--validation). Usage, from the repository root:
#   KVCC=build/cli/kvcc zoo/make_project_zoo.sh
set -euo pipefail
KVCC=${KVCC:-build/cli/kvcc}
SHARED=${SHARED:-../shared}
ZOO=${ZOO:-zoo/published}
WORK=${WORK:-$(mktemp -d /tmp/kvcc-zoo-XXXXXX)}
# kivi is left out of the choice: its default token group (32) exceeds the small models' head_dim.
METHODS=${METHODS:-oscar,oscar-lm,hadamard,identity,random,turboquant,kvarn}
mkdir -p "$WORK"

# First half of the documents of a text file (documents separated by <|endoftext|>).
first_half() {
  python3 - "$1" "$2" <<'PY'
import sys
docs = [d for d in open(sys.argv[1], encoding="utf-8").read().split("<|endoftext|>") if d.strip()]
half = docs[: len(docs) // 2]
open(sys.argv[2], "w", encoding="utf-8").write("<|endoftext|>".join(half))
print(f"{sys.argv[1]}: first {len(half)} of {len(docs)} documents")
PY
}

# Second (held-out) half of the documents, the same split as first_half.
second_half() {
  python3 - "$1" "$2" <<'PY'
import sys
docs = [d for d in open(sys.argv[1], encoding="utf-8").read().split("<|endoftext|>") if d.strip()]
half = docs[len(docs) // 2 :]
open(sys.argv[2], "w", encoding="utf-8").write("<|endoftext|>".join(half))
print(f"{sys.argv[1]}: last {len(half)} of {len(docs)} documents")
PY
}

# Prints "<best non-oscar method>" from a report JSON, and writes the notes text for the cards.
pick_and_note() {
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
report, notes_path, calib, heldout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
r = json.load(open(report))
methods = r["methods"]
others = [m for m in methods if not m["method"].startswith("oscar")]
best = min(others, key=lambda m: m["mean"]["output_rel"])
lines = [f"Calibration text: {calib}.",
         "Held-out attention-level errors from `kvcc report` (reservoir rows of held-out documents; mean relative "
         "Frobenius errors over layers and KV heads; 2-bit keys and values):", "",
         "| method | logit (q-weighted) | attention output | key | value | eff. bits @32K |", "|---|---|---|---|---|---|"]
for m in methods:
    e = m["mean"]
    lines.append(f"| {m['label']} | {e['logit_rel']:.4f} | {e['output_rel']:.4f} | {e['key_rel']:.4f} | "
                 f"{e['value_rel']:.4f} | {m['effective_bits'].get('32768', float('nan')):.3f} |")
lines += ["", f"The best non-OSCAR recipe here (lowest attention-output error) is {best['method']}.",
          f"Model-level validation (`kvcc validate`: perplexity, KL, top-1; pseudo-decode, sink 4 / recent 32 / "
          f"pages of 32) on {heldout} is attached; the report covers both of this model's zoo artifacts (one run)."]
open(notes_path, "w").write("\n".join(lines) + "\n")
print(best["method"])
PY
}

publish_model() {  # model_id model_path text_file validate_tokens (0: all)
  local id=$1 model=$2 text=$3 vtokens=$4
  local half="$WORK/$id.calib.txt" heldout="$WORK/$id.heldout.txt" stats="$WORK/$id.stats.h5"
  first_half "$text" "$half"
  second_half "$text" "$heldout"
  # An existing stats file in WORK is reused (calibrating gutenberg-27m takes ~25 min on 2 cores).
  [[ -f "$stats" ]] || "$KVCC" calibrate-model --model "$model" --data "$half" -o "$stats"
  "$KVCC" report "$stats" --methods "$METHODS" --json "$WORK/$id.report.json" > /dev/null
  local ndocs nheld
  ndocs=$(python3 -c "import sys; print(sum(1 for d in open(sys.argv[1], encoding='utf-8').read().split('<|endoftext|>') if d.strip()))" "$half")
  nheld=$(python3 -c "import sys; print(sum(1 for d in open(sys.argv[1], encoding='utf-8').read().split('<|endoftext|>') if d.strip()))" "$heldout")
  local vdesc="the last $nheld documents of $(basename "$text")"
  [[ "$vtokens" != 0 ]] && vdesc="$vdesc (first $vtokens tokens)"
  local best
  best=$(pick_and_note "$WORK/$id.report.json" "$WORK/$id.notes.md" "first $ndocs documents of $(basename "$text")" "$vdesc")
  local method arts=()
  for method in oscar "$best"; do
    "$KVCC" compile "$stats" --model-id "$id" -m "$method" --key-bits 2 --value-bits 2 -o "$WORK/$id.$method.kvcc.h5"
    arts+=(--artifact "$WORK/$id.$method.kvcc.h5")
  done
  "$KVCC" validate --model "$model" "${arts[@]}" --data "$heldout" --tokens "$vtokens" \
    --sink 4 --recent 32 --page-size 32 --json "$WORK/$id.validate.json" --svg "$WORK/$id.validate.svg"
  for method in oscar "$best"; do
    "$KVCC" zoo publish "$WORK/$id.$method.kvcc.h5" --zoo "$ZOO" --replace --card-notes "$(cat "$WORK/$id.notes.md")" \
      --validation "$WORK/$id.validate.json"
  done
}

MODELS=${MODELS:-tinystories-656k stories260k gutenberg-27m}
for m in $MODELS; do
  case $m in
    tinystories-656k) publish_model tinystories-656k "$SHARED/models/tinystories-656k" "$SHARED/text/tinystories_valid_100.txt" 0 ;;
    stories260k) publish_model stories260k "$SHARED/models/stories260k/stories260K.bin" "$SHARED/text/tinystories_valid_100.txt" 0 ;;
    gutenberg-27m) publish_model gutenberg-27m "$SHARED/models/gutenberg-27m" "$SHARED/text/gutenberg_heldout.txt" 4096 ;;
  esac
done
"$KVCC" zoo verify --zoo "$ZOO"
"$KVCC" zoo list --zoo "$ZOO"
