#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for kvcc's forward-pass tests.

Run from the repository root on a machine with torch + transformers (CPU is enough):
    python3 tests/reference/make_forward_refs.py
It writes into tests/data/models/:
  (a) refs/tinystories-656k.json, refs/gutenberg-27m.json: transformers' float32 logits of the real
      models in ../shared/models over a fixed token sequence;
  (b) tiny randomly initialised models saved by transformers (f32 safetensors), each with its own
      ref_logits.json: llama31-hd64 (llama3 rope scaling, transformers-4 style config rewritten by
      hand), llama31-hd128 (transformers-5 style, sharded), qwen3-hd64 (tied), qwen3-hd128,
      qwen2-bias (q/k/v biases, tied); llama-hd256 (head_dim 256, BF16 weights);
  refs/tinystories-656k-long.json: the same for 500 tokens of tinystories_valid_100.txt;
  (c) refs/stories260k.json: the llama2.c checkpoint converted to an HF Llama (q/k rows permuted
      from interleaved RoPE pairs to rotate_half) and run by transformers, plus its greedy
      continuation of a short prompt.
Each reference file holds the token ids, the positions checked and logits[position][vocab].
"""
import copy
import json
import os
import struct
import sys

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(ROOT, "..", "shared")
OUT = os.path.join(ROOT, "tests", "data", "models")
torch.set_grad_enabled(False)


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def logits_ref(model, ids, positions, extra=None):
    model.eval()
    out = model(torch.tensor([ids])).logits[0].float().numpy()
    ref = {
        "transformers_version": transformers.__version__,
        "ids": [int(i) for i in ids],
        "positions": positions,
        # repr of float32 values: 9 significant digits round-trip exactly
        "logits": [[float(f"{v:.9g}") for v in out[p]] for p in positions],
    }
    if extra:
        ref.update(extra)
    return ref


def inv_freq_of(model):
    return [float(v) for v in model.model.rotary_emb.inv_freq.double().numpy()]


# ---------------------------------------------------------------- (a) the real HF models
def real_models():
    from tokenizers import Tokenizer

    text = ("Once upon a time, there was a little girl named Lily. She loved to play in the park "
            "with her friends. One day, she saw a big red ball under a tree and ran to get it.")
    for name, t_len in [("tinystories-656k", 48), ("gutenberg-27m", 64)]:
        path = os.path.join(SHARED, "models", name)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        ids = tok.encode(text).ids[:t_len]  # the post-processor adds BOS for both
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        positions = [0, 1, len(ids) // 2, len(ids) - 1]
        extra = None
        if name == "tinystories-656k":
            # A trained model's greedy continuation (full recompute per step, as the C++ test does).
            prompt = "Once upon a time, there was a little"
            prompt_ids = tok.encode(prompt).ids
            gen = list(prompt_ids)
            for _ in range(40):
                gen.append(int(model(torch.tensor([gen])).logits[0, -1].argmax()))
            continuation = gen[len(prompt_ids):]
            extra = {"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": continuation,
                     "greedy_text": tok.decode(continuation)}
            print(f"  {name} greedy: {prompt!r} -> {extra['greedy_text']!r}")
        write_json(os.path.join(OUT, "refs", name + ".json"),
                   logits_ref(model, ids, positions, extra))


# ---------------------------------------------------------------- (b) tiny random models
def randomize(model, seed):
    # transformers' default init (std 0.02) gives near-uniform attention and logits, which would
    # hide RoPE or masking mistakes; fan-in scaled weights and non-unit norms do not.
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))


def tiny_models():
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=128,
                  max_position_embeddings=256, rms_norm_eps=1e-5)
    specs = [
        ("llama31-hd64", LlamaForCausalLM,
         LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     rope_parameters=dict(llama3), tie_word_embeddings=False, **common), None, True),
        ("llama31-hd128", LlamaForCausalLM,
         LlamaConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                     rope_parameters=dict(llama3), tie_word_embeddings=False, **common), "60KB", False),
        ("qwen3-hd64", Qwen3ForCausalLM,
         Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     tie_word_embeddings=True, **common), None, False),
        ("qwen3-hd128", Qwen3ForCausalLM,
         Qwen3Config(num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     tie_word_embeddings=False, **common), None, False),
        ("qwen2-bias", Qwen2ForCausalLM,
         Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     tie_word_embeddings=True, **common), None, False),
    ]
    for i, (name, cls, config, shard, v4_style) in enumerate(specs):
        torch.manual_seed(i)
        model = cls(config).float()
        randomize(model, 1000 + i)
        path = os.path.join(OUT, name)
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(path):
            os.remove(os.path.join(path, f))
        if shard:
            model.save_pretrained(path, max_shard_size=shard)
        else:
            model.save_pretrained(path)
        for f in ["generation_config.json"]:
            if os.path.exists(os.path.join(path, f)):
                os.remove(os.path.join(path, f))
        if v4_style:
            # The same model described the transformers-4 way, so both config styles are covered.
            cfg_path = os.path.join(path, "config.json")
            with open(cfg_path) as f:
                cfg = json.load(f)
            rope = cfg.pop("rope_parameters")
            cfg["rope_theta"] = rope.pop("rope_theta")
            cfg["rope_scaling"] = rope
            cfg["torch_dtype"] = cfg.pop("dtype", "float32")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
        g = torch.Generator().manual_seed(7 + i)
        ids = [1] + torch.randint(3, config.vocab_size, (47,), generator=g).tolist()
        positions = [0, 5, 17, 30, 40, 47]
        write_json(os.path.join(path, "ref_logits.json"),
                   logits_ref(model, ids, positions, {"inv_freq": inv_freq_of(model)}))
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"  {name}: {size} bytes in {sorted(os.listdir(path))}")


def hd256_models():
    # head_dim 256 on a GQA Llama, stored in BF16 to keep the file small; the reference is
    # transformers' float32 run of the BF16 weights.
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=128,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=256, tie_word_embeddings=False)
    specs = [
        ("llama-hd256", LlamaForCausalLM,
         LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)),
    ]
    for i, (name, cls, config) in enumerate(specs):
        torch.manual_seed(100 + i)
        model = cls(config).float()
        randomize(model, 3000 + i)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        path = os.path.join(OUT, name)
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(path):
            os.remove(os.path.join(path, f))
        # A BF16 copy is saved: converting the model itself would round its RoPE inv_freq buffer too.
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
        if os.path.exists(os.path.join(path, "generation_config.json")):
            os.remove(os.path.join(path, "generation_config.json"))
        g = torch.Generator().manual_seed(70 + i)
        ids = [1] + torch.randint(3, config.vocab_size, (47,), generator=g).tolist()
        write_json(os.path.join(path, "ref_logits.json"),
                   logits_ref(model, ids, [0, 5, 17, 30, 40, 47], {"inv_freq": inv_freq_of(model)}))
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"  {name}: {size} bytes in {sorted(os.listdir(path))}")


# ---------------------------------------------------------------- (c) stories260k via HF Llama
def read_llama2c(path):
    with open(path, "rb") as f:
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("7i", f.read(28))
        data = np.frombuffer(f.read(), dtype=np.float32)
    shared = vocab > 0
    vocab = abs(vocab)
    hd = dim // n_heads
    kv_dim = n_kv * hd
    offset = 0

    def take(*shape):
        nonlocal offset
        n = int(np.prod(shape))
        a = data[offset:offset + n].reshape(shape)
        offset += n
        return torch.from_numpy(a.copy())

    w = {"emb": take(vocab, dim), "att_norm": take(n_layers, dim), "wq": take(n_layers, dim, dim),
         "wk": take(n_layers, kv_dim, dim), "wv": take(n_layers, kv_dim, dim),
         "wo": take(n_layers, dim, dim), "ffn_norm": take(n_layers, dim),
         "w1": take(n_layers, hidden, dim), "w2": take(n_layers, dim, hidden),
         "w3": take(n_layers, hidden, dim), "norm": take(dim)}
    take(seq_len, hd // 2)
    take(seq_len, hd // 2)
    w["cls"] = w["emb"] if shared else take(vocab, dim)
    return (dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len, shared), w


def interleaved_to_rotate_half(w, n_heads, hd):
    # llama2.c rotates channel pairs (2i, 2i+1); HF rotates (i, i+hd/2). Reordering each head's
    # output rows [0,2,4,...,1,3,5,...] makes HF's RoPE compute the same attention.
    order = list(range(0, hd, 2)) + list(range(1, hd, 2))
    return w.view(n_heads, hd, -1)[:, order, :].reshape(n_heads * hd, -1)


def llama2c_vocab(path, vocab):
    with open(path, "rb") as f:
        f.read(4)
        pieces, scores = [], []
        for _ in range(vocab):
            score, n = struct.unpack("fi", f.read(8))
            pieces.append(f.read(n))
            scores.append(score)
    return pieces, scores


def llama2c_encode(text, pieces, scores):
    # llama2.c's run.c encode(): a dummy-prefix space, one token per character, then repeated
    # merges of the best-scoring adjacent pair.
    index = {p: i for i, p in enumerate(pieces)}
    ids = [index[c.encode()] for c in " " + text]
    while True:
        best = None
        for i in range(len(ids) - 1):
            merged = pieces[ids[i]] + pieces[ids[i + 1]]
            if merged in index and (best is None or scores[index[merged]] > best[0]):
                best = (scores[index[merged]], i, index[merged])
        if best is None:
            return ids
        _, i, tid = best
        ids[i:i + 2] = [tid]


def stories260k():
    src = os.path.join(SHARED, "models", "stories260k")
    (dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len, shared), w = read_llama2c(
        os.path.join(src, "stories260K.bin"))
    hd = dim // n_heads
    config = LlamaConfig(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=n_layers,
                         num_attention_heads=n_heads, num_key_value_heads=n_kv, vocab_size=vocab,
                         max_position_embeddings=seq_len, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=shared, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).float()
    sd = {"model.embed_tokens.weight": w["emb"], "model.norm.weight": w["norm"],
          "lm_head.weight": w["cls"]}
    for l in range(n_layers):
        p = f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = w["att_norm"][l]
        sd[p + "self_attn.q_proj.weight"] = interleaved_to_rotate_half(w["wq"][l], n_heads, hd)
        sd[p + "self_attn.k_proj.weight"] = interleaved_to_rotate_half(w["wk"][l], n_kv, hd)
        sd[p + "self_attn.v_proj.weight"] = w["wv"][l]
        sd[p + "self_attn.o_proj.weight"] = w["wo"][l]
        sd[p + "post_attention_layernorm.weight"] = w["ffn_norm"][l]
        sd[p + "mlp.gate_proj.weight"] = w["w1"][l]
        sd[p + "mlp.down_proj.weight"] = w["w2"][l]
        sd[p + "mlp.up_proj.weight"] = w["w3"][l]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    if shared:
        model.tie_weights()
    model.eval()

    pieces, scores = llama2c_vocab(os.path.join(src, "tok512.bin"), vocab)
    prompt = "Once upon a time, there was a little"
    prompt_ids = [1] + llama2c_encode(prompt, pieces, scores)
    ids = list(prompt_ids)
    for _ in range(40):  # greedy, full recompute: the same thing the C++ test does
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    continuation = ids[len(prompt_ids):]
    text = b"".join(pieces[i] for i in continuation).decode("utf-8", "replace")
    print(f"  stories260k greedy: {prompt!r} -> {text!r}")
    seq = ids[:48]
    write_json(os.path.join(OUT, "refs", "stories260k.json"),
               logits_ref(model, seq, [0, 3, 20, 47],
                          {"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": continuation,
                           "greedy_text": text}))


def long_sequence():
    # 500 tokens of real text, so RoPE angles at large positions are compared too.
    from tokenizers import Tokenizer

    path = os.path.join(SHARED, "models", "tinystories-656k")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(SHARED, "text", "tinystories_valid_100.txt")) as f:
        text = f.read().replace("<|endoftext|>", "\n")
    ids = tok.encode(text).ids[:500]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    write_json(os.path.join(OUT, "refs", "tinystories-656k-long.json"),
               logits_ref(model, ids, [257, 499]))


if __name__ == "__main__":
    what = sys.argv[1:] or ["real", "tiny", "hd256", "stories", "long"]
    if "tiny" in what:
        tiny_models()
    if "hd256" in what:
        hd256_models()
    if "stories" in what:
        stories260k()
    if "real" in what:
        real_models()
    if "long" in what:
        long_sequence()
