# Sourced by scripts/fuzz.sh and scripts/sanitize_check.sh (from the repository root):
#   fuzz_seeds TARGET DIR        copies TARGET's seed files into DIR (nothing is committed: the
#                                seeds are the project's real files, copied at run time)
#   fuzz_max_len TARGET          libFuzzer's -max_len for TARGET (the largest seed must fit whole)
#   fuzz_regressions TARGET      the regression inputs tests/fuzz/regressions holds for TARGET
# Needs BUILD_DIR (for fuzz_make_seeds). SHARED (default ../shared) holds the real models; when
# it is absent, only the repository's own files seed the corpora.
FUZZ_TARGETS=(fuzz_artifact fuzz_stats fuzz_safetensors fuzz_model_index fuzz_hf_config fuzz_llama2c
  fuzz_tokenizer_json fuzz_tokenizer_bin fuzz_torch_pt fuzz_pickle fuzz_zoo_index fuzz_token_ids)
SHARED=${SHARED:-../shared}

# The first file name extension of TARGET's inputs, used for kept regression inputs.
fuzz_extension() {
  case "$1" in
    fuzz_artifact | fuzz_stats) echo h5 ;;
    fuzz_safetensors) echo safetensors ;;
    fuzz_model_index | fuzz_hf_config | fuzz_tokenizer_json | fuzz_zoo_index) echo json ;;
    fuzz_llama2c | fuzz_tokenizer_bin) echo bin ;;
    fuzz_torch_pt) echo pt ;;
    fuzz_pickle) echo pkl ;;
    fuzz_token_ids) echo ids ;;
    *) echo "unknown fuzz target $1" >&2; return 1 ;;
  esac
}

fuzz_max_len() {
  case "$1" in
    fuzz_llama2c) echo $((2 << 20)) ;;  # stories260K.bin is 1.1 MB
    *) echo $((1 << 20)) ;;
  esac
}

fuzz_regressions() {
  local target=$1
  # The HDF5 inputs (mutation-test files included) go through both HDF5 readers.
  if [ "$(fuzz_extension "$target")" = h5 ]; then
    find tests/fuzz/regressions -maxdepth 1 -type f -name '*.h5' | sort
  else
    find tests/fuzz/regressions -maxdepth 1 -type f -name "$target-*" | sort
  fi
}

# Copies each existing FILE (glob results that did not match are skipped) into DIR, prefixing
# PREFIX to its name so that files of the same name from different models stay apart.
_fuzz_copy() {
  local dir=$1 prefix=$2 f
  shift 2
  for f in "$@"; do [ -f "$f" ] && cp "$f" "$dir/$prefix$(basename "$f")"; done
  return 0
}

fuzz_seeds() {
  local target=$1 dir=$2 d a
  mkdir -p "$dir"
  case "$target" in
    # The small published artifacts (the 4 MB ones run at a tenth of the speed and fill the corpus),
    # and the same artifacts in the safetensors container (read_artifact takes both).
    fuzz_artifact)
      find zoo/published -name 'artifact.*.kvcc.h5' -size -1024k -exec cp {} "$dir/" \;
      for a in "$dir"/*.kvcc.h5; do "$BUILD_DIR/tests/fuzz/fuzz_make_seeds" --safetensors "$a" "${a%.h5}.safetensors"; done
      ;;
    fuzz_stats) "$BUILD_DIR/tests/fuzz/fuzz_make_seeds" "$dir/stats.h5" >/dev/null ;;
    fuzz_safetensors)
      for d in tests/data/models/*/; do
        _fuzz_copy "$dir" "$(basename "$d")-" "$d"*.safetensors
      done
      ;;
    fuzz_model_index)
      for d in tests/data/models/*/ "$SHARED"/models/*/; do
        _fuzz_copy "$dir" "$(basename "$d")-" "$d"model.safetensors.index.json
      done
      ;;
    fuzz_hf_config)
      for d in tests/data/models/*/ "$SHARED"/models/*/; do _fuzz_copy "$dir" "$(basename "$d")-" "$d"config.json; done
      ;;
    fuzz_llama2c) _fuzz_copy "$dir" "" cli/demo/stories260k/stories260K.bin ;;
    fuzz_tokenizer_json)
      for d in "$SHARED"/models/*/; do _fuzz_copy "$dir" "$(basename "$d")-" "$d"tokenizer.json; done
      ;;
    fuzz_tokenizer_bin) _fuzz_copy "$dir" "" cli/demo/stories260k/tok512.bin "$SHARED"/models/*/tok*.bin ;;
    fuzz_torch_pt) _fuzz_copy "$dir" "" tests/data/oscar/*.pt ;;
    fuzz_pickle)
      # The data.pkl of each .pt archive (python3's zipfile; without python3 the corpus starts empty).
      for a in tests/data/oscar/*.pt; do
        python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
n = [x for x in z.namelist() if x.endswith("/data.pkl")][0]
open(sys.argv[2], "wb").write(z.read(n))' "$a" "$dir/$(basename "$a" .pt).pkl" 2>/dev/null || true
      done
      ;;
    fuzz_zoo_index) _fuzz_copy "$dir" "" zoo/published/index.json ;;
    fuzz_token_ids)
      printf '1 2 3\n17 4096\n0\n' >"$dir/three-docs.ids"
      printf '1 403 407 261 3 0 17\n\n2147483647 5\n' >"$dir/blank-line.ids"
      ;;
    *) echo "unknown fuzz target $target" >&2; return 1 ;;
  esac
  local f
  while read -r f; do [ -n "$f" ] && [ "$(stat -c %s "$f")" -le "$(fuzz_max_len "$target")" ] && cp "$f" "$dir/"; done \
    < <(fuzz_regressions "$target")
  return 0
}
