#!/usr/bin/env python3
"""Tiny FP8 checkpoints for kvcc's quantized-weight tests, made with torch's float8_e4m3fn.

Run from the repository root on a machine with torch + transformers + safetensors (CPU is enough):
    python3 tests/reference/make_quantized_models.py
It writes into tests/data/models/ three random-weight models whose linear layers are stored in
F8_E4M3 with float scales, as real checkpoints store them:
  llama-fp8-block: quant_method "fp8" (DeepSeek-V3 / Qwen3-FP8 layout), weight_block_size
      [128, 128], F32 `weight_scale_inv` [ceil(out/128), ceil(in/128)]; every matrix has a partial
      last block in both directions; embeddings and lm_head stay BF16 (modules_to_not_convert);
  qwen3-ct-channel: compressed-tensors float-quantized, strategy channel: BF16 `weight_scale`
      [out, 1], dynamic activations (no activation scales);
  llama-ct-tensor: compressed-tensors float-quantized, strategy tensor: F32 `weight_scale` [1] and
      static activation scales `input_scale` [1] (which kvcc does not apply).
Each directory holds dequantized.json: per quantized tensor the sha256 of torch's dequantization
`w.float() * scale` (scales expanded over their blocks) as little-endian float32 bytes, the
independent reference the C++ reader is compared with bit for bit.
"""
import hashlib
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "models")
E4M3_MAX = 448.0
torch.set_grad_enabled(False)


def randomize(model, seed):
    # Fan-in scaled weights and non-unit norms, as make_forward_refs.py (default init hides mistakes).
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))


def expand(scale, rows, cols, block_rows, block_cols):
    """A scale grid [ceil(rows/br), ceil(cols/bc)] repeated over its blocks and cut to [rows, cols]."""
    return scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]


def quantize(w, block_rows, block_cols, scale_dtype):
    """E4M3 codes and the scale grid of one [out, in] weight (scale = block amax / 448)."""
    rows, cols = w.shape
    gr, gc = -(-rows // block_rows), -(-cols // block_cols)
    scale = torch.zeros(gr, gc)
    for i in range(gr):
        for j in range(gc):
            block = w[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols]
            scale[i, j] = block.abs().max() / E4M3_MAX
    scale = scale.to(scale_dtype)
    codes = (w / expand(scale.float(), rows, cols, block_rows, block_cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return codes.to(torch.float8_e4m3fn), scale


def dequantized_sha256(codes, scale, block_rows, block_cols):
    rows, cols = codes.shape
    grid = scale.float().reshape(-(-rows // block_rows), -(-cols // block_cols))
    w = codes.float() * expand(grid, rows, cols, block_rows, block_cols)
    return hashlib.sha256(w.contiguous().numpy().astype("<f4").tobytes()).hexdigest()


def make(name, model, quantization_config, strategy, scale_dtype, scale_suffix, input_scales=False):
    path = os.path.join(OUT, name)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        os.remove(os.path.join(path, f))
    model.config.quantization_config = quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    tensors, digests = {}, {}
    for key, p in model.state_dict().items():
        p = p.detach().contiguous()
        if p.dim() != 2 or "embed_tokens" in key or key == "lm_head.weight":
            tensors[key] = p.to(torch.bfloat16)
            continue
        rows, cols = p.shape
        br, bc = {"block": (128, 128), "channel": (1, cols), "tensor": (rows, cols)}[strategy]
        codes, scale = quantize(p.float(), br, bc, scale_dtype)
        if strategy == "tensor":
            scale = scale.reshape(1)
        tensors[key] = codes
        tensors[key + scale_suffix] = scale
        if input_scales:
            tensors[key.removesuffix("weight") + "input_scale"] = torch.tensor([0.0125])
        digests[key] = dequantized_sha256(codes, scale, br, bc)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(path, "model.safetensors"), 0o644)
    with open(os.path.join(path, "dequantized.json"), "w") as f:
        json.dump({"torch_version": torch.__version__, "transformers_version": transformers.__version__,
                   "dequantized_f32_sha256": digests}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote tests/data/models/{name} ({os.path.getsize(os.path.join(path, 'model.safetensors'))} bytes)")


def main():
    # Every matrix of the block model crosses a 128 boundary (or stays below one) in both directions.
    torch.manual_seed(20)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=160, intermediate_size=136, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=72, vocab_size=64,
                                         max_position_embeddings=256, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False)).float()
    randomize(llama, 2000)
    make("llama-fp8-block", llama, {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]},
         "block", torch.float32, "_scale_inv")

    def ct_config(strategy, activations):
        return {"config_groups": {"group_0": {
                    "input_activations": activations, "output_activations": None, "targets": ["Linear"],
                    "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                                "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": strategy,
                                "symmetric": True, "type": "float"}}},
                "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
                "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}

    torch.manual_seed(21)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=64,
                                         max_position_embeddings=256, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False)).float()
    randomize(qwen3, 2001)
    dynamic = {"dynamic": True, "num_bits": 8, "observer": None, "strategy": "token", "symmetric": True,
               "type": "float"}
    make("qwen3-ct-channel", qwen3, ct_config("channel", dynamic), "channel", torch.bfloat16, "_scale")

    torch.manual_seed(22)
    small = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=256, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False)).float()
    randomize(small, 2002)
    static = {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "tensor", "symmetric": True,
              "type": "float"}
    make("llama-ct-tensor", small, ct_config("tensor", static), "tensor", torch.float32, "_scale",
         input_scales=True)


if __name__ == "__main__":
    main()
