"""python -m kvcc.generate: a greedy continuation of a prompt through the INT2 KV cache.

Loads a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3 and relatives) and, with --artifact,
runs its attention through kvcc's paged INT2 cache (kvcc.hf); without --artifact through
transformers' own cache (SDPA), the baseline to compare against.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EPILOG = """\
what it does:
  Tokenizes PROMPT with the model's tokenizer, then generates greedily (argmax, no sampling)
  up to N new tokens (stopping early at the model's end-of-sequence token) and prints the
  continuation on stdout. With --artifact the KV cache is the one the artifact compiles: the
  first `sink` tokens and the last `recent` tokens in BF16, everything between in INT2 pages
  (~2.25 bits per element), keys and values rotated by the artifact's rotations; the artifact
  must be compiled for this model (same layers, query / KV heads and head_dim), else it is
  refused. On the CPU the runtime's reference kernels run (exact, slow); --device cuda runs
  its Hopper (sm_90) kernels. Timings and the cache's bytes go to stderr.

examples:
  python -m kvcc.generate --model ../shared/models/gutenberg-27m \\
      --artifact zoo/published/gutenberg-27m/oscar-int2-g128-p2/artifact.c50773be60ee.kvcc.h5 \\
      --prompt "It was a dark and stormy night" --max-new-tokens 40
  # the zoo's oscar artifact for this model (matched by the model's fingerprint)
  python -m kvcc.generate --model ../shared/models/gutenberg-27m --artifact zoo \\
      --prompt "It was a dark and stormy night" --max-new-tokens 40
  # the same through transformers' own BF16/FP32 cache, to compare
  python -m kvcc.generate --model ../shared/models/gutenberg-27m \\
      --prompt "It was a dark and stormy night" --max-new-tokens 40
  # find an artifact for a model in the zoo: build/cli/kvcc zoo find --model DIR --zoo zoo/published
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvcc.generate",
        description="Greedy text continuation through kvcc's INT2 KV cache (or transformers' own cache).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory (config.json, weights, "
                   "tokenizer)")
    p.add_argument("--artifact", metavar="FILE", help="compiled kvcc artifact (.kvcc.h5) for this model, or 'zoo' "
                   "('zoo:METHOD') for the zoo's artifact for it (by fingerprint; $KVCC_ZOO or zoo/published); "
                   "omit for transformers' own cache")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': stdin)")
    p.add_argument("--max-new-tokens", required=True, type=_non_negative, metavar="N", help="tokens to generate "
                   "at most (>= 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and cache run "
                   "(default: cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model weights and activations (auto: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    return p


def _non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    with open(args.prompt_file, encoding="utf-8") as f:
        return f.read()


def run(args: argparse.Namespace) -> tuple[str, str]:
    """Generates; returns (prompt, continuation text)."""
    import torch
    from transformers import AutoTokenizer

    from . import hf
    from ._lib import KvccError

    if not os.path.isdir(args.model):
        raise KvccError(f"no such model directory: {args.model}")
    if args.artifact is not None and args.artifact != "zoo" and not args.artifact.startswith("zoo:") and not os.path.isfile(args.artifact):
        raise KvccError(f"no such artifact: {args.artifact}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise KvccError("--device cuda: torch sees no CUDA device")
    prompt = _read_prompt(args)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(prompt, return_tensors="pt").input_ids.to(args.device)
    if ids.shape[1] == 0:
        raise KvccError("the prompt encodes to no tokens")
    model = hf.from_pretrained(args.model, artifact=args.artifact, device=args.device, dtype=dtype)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    cache = f"kvcc INT2 ({os.path.basename(model.kvcc_artifact.path)})" if args.artifact else "transformers (SDPA)"
    print(f"[{ids.shape[1]} prompt tokens, {len(new)} generated in {seconds:.2f} s on {args.device}; cache: {cache}]",
          file=sys.stderr)
    return prompt, text


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ._lib import KvccError

    try:
        prompt, text = run(args)
    except (KvccError, OSError, ValueError) as e:
        print(f"python -m kvcc.generate: error: {e}", file=sys.stderr)
        return 1
    if args.echo:
        sys.stdout.write(prompt)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
