#!/usr/bin/env python3
"""Reference token ids for tests/test_tokenizer*.cpp, made by independent implementations.

* tinystories-656k and gutenberg-27m (tokenizer.json): the Hugging Face `tokenizers` library.
  Every document of the shared texts is encoded (with the template's BOS); per document the id
  count and sha256 of the ids (little-endian int32) are kept, plus the full ids of the first few.
* stories260k (llama2.c tok512.bin): a Python re-derivation of llama2.c's run.c encode from the
  file format (dummy-prefix space, UTF-8 characters looked up whole else <0xXX> at byte+3, then
  greedy merges of the best-scoring adjacent pair, leftmost on ties).
* cases.json: short edge-case strings (special tokens, unknown characters, whitespace, digits,
  empty text, and random mixtures of them) for every tokenizer, and for tokenizer.json variants made by patching the real
  files (the patches are stored so the C++ test applies the same ones).

Documents are split as kvcc::split_documents does: on <|endoftext|>, each trimmed of ASCII
whitespace, empty ones dropped.

Run from the repository root:  python3 tests/reference/make_tokenizer_refs.py
"""
import copy
import hashlib
import json
import os
import random
import struct
import sys

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(ROOT, "..", "shared")
OUT = os.path.join(ROOT, "tests", "data", "tokenizer")
WHITESPACE = " \t\n\r\f\v"


def split_documents(text, separator="<|endoftext|>"):
    return [d.strip(WHITESPACE) for d in text.split(separator) if d.strip(WHITESPACE)]


def ids_sha256(ids):
    return hashlib.sha256(struct.pack("<%di" % len(ids), *ids)).hexdigest()


def read_text(name):
    with open(os.path.join(SHARED, "text", name), encoding="utf-8") as f:
        return f.read()


def hf_reference(model, text_name, full_documents):
    tok = Tokenizer.from_file(os.path.join(SHARED, "models", model, "tokenizer.json"))
    docs = split_documents(read_text(text_name))
    encodings = tok.encode_batch(docs)  # add_special_tokens=True: the template's BOS
    ids = [e.ids for e in encodings]
    return {
        "tokenizer": "models/%s/tokenizer.json" % model,
        "text": "text/" + text_name,
        "add_bos": True,
        "made_by": "tokenizers " + __import__("tokenizers").__version__,
        "documents": [{"count": len(i), "sha256": ids_sha256(i)} for i in ids],
        "first_ids": ids[:full_documents],
    }


class Llama2cTokenizer:
    """llama2.c tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length, bytes."""

    def __init__(self, path):
        with open(path, "rb") as f:
            data = f.read()
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        offset = 4
        self.pieces, self.scores = [], []
        while offset < len(data):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            self.pieces.append(data[offset:offset + length])
            self.scores.append(score)
            offset += length
        self.lookup = {}
        for i, p in enumerate(self.pieces):
            self.lookup.setdefault(p, i)

    def encode(self, text, bos):
        ids = [1] if bos else []
        if text:
            ids.append(self.lookup[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.lookup:
                ids.append(self.lookup[b])
            else:
                ids.extend(x + 3 for x in b)
        while True:
            best = (-1e10, None, None)
            for i in range(len(ids) - 1):
                merged = self.lookup.get(self.pieces[ids[i]] + self.pieces[ids[i + 1]])
                if merged is not None and self.scores[merged] > best[0]:
                    best = (self.scores[merged], merged, i)
            if best[1] is None:
                return ids
            ids[best[2]:best[2] + 2] = [best[1]]


CASES = [
    "",
    " ",
    "\n",
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "  two leading spaces and two trailing  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "It's they're we'll I'd YOU'VE",
    "numbers 1234567 and 3.14159, 2024-11-29",
    "caf\u00e9 na\u00efve \u00a3\u00bd \u201cquoted\u201d \u2014 dash",
    "\u65e5\u672c\u8a9e \u0645\u0631\u062d\u0628\u0627 \U0001F642\U0001F643",
    "\u00a0non-breaking\u2003em space",
    "...!!!???",
    "<|begin_of_text|>Hello<|end_of_text|>",
    "a <|end_of_text|>  b",
    "<|start_story|>Once upon a time",
    "Hi <|start_story|> there",
    "a<|start_story|>b",
    "<unk> <|end_story|>",
    "x<|endoftext|>y",
    "cafe\u0301 (decomposed) \ufb01ne \u2460 \uff21",
    "a <|end_of_text|>\u00a0\u2003b",
]


def random_cases(count, seed):
    """Short random mixtures of story words, punctuation, whitespace, non-ASCII and special tokens."""
    rng = random.Random(seed)
    atoms = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \t\n\r  .,;:!?'\"()-") + [
        "'s", "'LL", "\u2019", "\u00e9", "\u00df", "\u65e5", "\U0001F642", "\u00a0", "\u2003", "\u0301", "1234",
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_story|>", "<unk>", "\u2581", "\u0120", "\x7f", "\u0085"]
    words = read_text("tinystories_valid_100.txt").split()[:3000]
    return ["".join(rng.choice(atoms) if rng.random() < 0.6 else " " + rng.choice(words)
                    for _ in range(rng.randint(0, 30))) for _ in range(count)]

# tokenizer.json variants: (name, base model, {JSON pointer: new value}); they exercise the
# pre-tokenizers, decoders and model options the two real files do not use.
VARIANTS = [
    ("gutenberg-27m+gpt2-bytelevel", "gutenberg-27m", {
        "/pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    }),
    ("gutenberg-27m+ignore-merges", "gutenberg-27m", {"/model/ignore_merges": True}),
    ("gutenberg-27m+strip-added", "gutenberg-27m", {"/added_tokens/1/lstrip": True, "/added_tokens/1/rstrip": True}),
    ("gutenberg-27m+split-behaviors", "gutenberg-27m", {
        "/pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Contiguous", "invert": False},
            {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[,.]"}, "behavior": "Removed", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[a-z]+"}, "behavior": "Isolated", "invert": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
    }),
    ("gutenberg-27m+nfc", "gutenberg-27m", {"/normalizer": {"type": "NFC"}}),
    ("gutenberg-27m+nfkc", "gutenberg-27m", {"/normalizer": {"type": "NFKC"}}),
    ("tinystories-656k+metaspace-pretokenizer", "tinystories-656k", {
        "/normalizer": None,
        "/pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
        "/decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
    }),
]


def apply_patch(doc, pointer, value):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    node = doc
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def case_results(tok, texts=CASES):
    # Decoded text is kept only where no special token occurs: kvcc skips special tokens when
    # decoding, while this library keeps those whose content a normalizer changed (tinystories'
    # "<|start_story|>" becomes "\u2581<|start_story|>", which its skip list does not recognise).
    special = {t["id"] for t in json.loads(tok.to_str())["added_tokens"] if t["special"]}
    out = []
    for text in texts:
        plain = tok.encode(text, add_special_tokens=False).ids
        with_bos = tok.encode(text, add_special_tokens=True).ids
        decoded = None if special & set(plain) else tok.decode(plain)
        out.append({"text": text, "ids": plain, "ids_bos": with_bos, "decoded": decoded})
    return out


def main():
    if not os.path.isdir(SHARED):
        sys.exit("no ../shared beside the repository")
    os.makedirs(OUT, exist_ok=True)
    refs = {
        "tinystories-656k.json": hf_reference("tinystories-656k", "tinystories_valid_100.txt", 3),
        "gutenberg-27m.json": hf_reference("gutenberg-27m", "gutenberg_heldout.txt", 2),
    }
    llama2c = Llama2cTokenizer(os.path.join(SHARED, "models", "stories260k", "tok512.bin"))
    stories = split_documents(read_text("tinystories_valid_100.txt"))[:20]
    refs["stories260k.json"] = {
        "tokenizer": "models/stories260k/tok512.bin",
        "text": "text/tinystories_valid_100.txt",
        "add_bos": True,
        "made_by": "make_tokenizer_refs.py (Python re-derivation of llama2.c run.c encode)",
        "first_ids": [llama2c.encode(d, True) for d in stories],
    }

    cases = {"tokenizers": {}, "variants": {}}
    for model in ("tinystories-656k", "gutenberg-27m"):
        tok = Tokenizer.from_file(os.path.join(SHARED, "models", model, "tokenizer.json"))
        cases["tokenizers"][model] = case_results(tok, CASES + random_cases(150, seed=len(model)))
    cases["tokenizers"]["stories260k"] = [
        {"text": t, "ids": llama2c.encode(t, False), "ids_bos": llama2c.encode(t, True), "decoded": t} for t in CASES]
    for name, base, patches in VARIANTS:
        with open(os.path.join(SHARED, "models", base, "tokenizer.json"), encoding="utf-8") as f:
            doc = json.load(f)
        for pointer, value in patches.items():
            apply_patch(doc, pointer, value)
        tok = Tokenizer.from_str(json.dumps(doc))
        cases["variants"][name] = {"base": base, "patches": patches, "cases": case_results(tok)}
    refs["cases.json"] = cases

    for name, content in refs.items():
        path = os.path.join(OUT, name)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        os.replace(path + ".tmp", path)
        print("wrote %s (%d bytes)" % (os.path.relpath(path, ROOT), os.path.getsize(path)))


if __name__ == "__main__":
    main()
