"""FP8 checkpoints for the PyTorch producer, dequantized by kvcc (port of formats/quantized_weights.cpp).

transformers cannot load them on a CPU without extra packages (quant_method "fp8" needs
`accelerate`, "compressed-tensors" the `compressed-tensors` package), and its FP8 dequantization
derives the block size from the weight and scale shapes (rows // scale_rows), which is wrong for a
weight whose size is not a multiple of the block. So kvcc reads such a checkpoint itself: every
F8_E4M3 weight becomes `w.float() * scale` over its blocks in float32 (one rounding, as the C++
reader), handed to transformers as the state dict of the same model without its
quantization_config. Activation scales are not applied (the model is its dequantized weights).

Formats (config.json `quantization_config`):
- quant_method "fp8": WEIGHT_scale_inv [ceil(out/bo), ceil(in/bi)] for weight_block_size [bo, bi]
  (default [128, 128]; null: one scale of shape [] or [1]);
- quant_method "compressed-tensors", format "float-quantized", 8-bit symmetric float weights:
  WEIGHT_scale [] or [1] (strategy tensor), [out, 1] (channel), [out, ceil(in/g)] (group g),
  [ceil(out/bo), ceil(in/bi)] (block).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvcc._stats_h5 import KvccError, require, weight_entries

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


@dataclass
class WeightQuantization:
    method: str = ""  # "" | "fp8" | "compressed-tensors"
    scale_suffix: str = ""  # "_scale_inv" | "_scale"
    strategy: str = ""  # "block" | "tensor" | "channel" | "group"
    block_rows: int = 0  # 0: the whole dimension
    block_cols: int = 0


def _present(j, key) -> bool:
    return isinstance(j, dict) and j.get(key) is not None


def _string(j, key, where) -> str:
    require(isinstance(j[key], str), f"{where}: field '{key}' must be a string")
    return j[key]


def _positive_pair(v, what):
    require(isinstance(v, list) and len(v) == 2, f"{what} must be a pair of positive integers, got {json.dumps(v)}")
    for i, x in enumerate(v):
        require(isinstance(x, int) and not isinstance(x, bool) and 1 <= x < 2**31,
                f"{what}[{i}] must be an integer from 1 to {2**31 - 1}, got {json.dumps(x)}")
    return int(v[0]), int(v[1])


def _parse_fp8(q, where) -> WeightQuantization:
    w = WeightQuantization("fp8", "_scale_inv")
    if _present(q, "fmt"):
        fmt = _string(q, "fmt", where)
        require(fmt == "e4m3", f"{where}: fp8 fmt '{fmt}' is not supported (kvcc reads e4m3)")
    if _present(q, "scale_fmt"):
        fmt = _string(q, "scale_fmt", where)
        require(fmt == "float", f"{where}: fp8 scale_fmt '{fmt}' is not supported (kvcc reads float scales)")
    if _present(q, "expert_dtype"):
        e = _string(q, "expert_dtype", where)
        require(e == "fp8", f"{where}: fp8 expert_dtype '{e}' is not supported (kvcc reads fp8)")
    if _present(q, "activation_scheme"):
        a = _string(q, "activation_scheme", where)
        require(a in ("dynamic", "static"), f"{where}: fp8 activation_scheme '{a}' is not dynamic or static")
    if "weight_block_size" not in q:  # transformers' default
        w.strategy, w.block_rows, w.block_cols = "block", 128, 128
    elif q["weight_block_size"] is None:
        w.strategy = "tensor"
    else:
        w.strategy = "block"
        w.block_rows, w.block_cols = _positive_pair(q["weight_block_size"], f"{where}: field 'weight_block_size'")
    return w


def _parse_compressed_tensors(q, where) -> WeightQuantization:
    w = WeightQuantization("compressed-tensors", "_scale")
    if _present(q, "quantization_status"):
        s = _string(q, "quantization_status", where)
        require(s == "compressed", f"{where}: compressed-tensors quantization_status '{s}' is not supported (kvcc "
                "reads compressed checkpoints)")
    top = _string(q, "format", where) if _present(q, "format") else ""
    groups = q.get("config_groups")
    require(isinstance(groups, dict) and groups, f"{where}: compressed-tensors quantization_config lacks "
            "'config_groups'")
    for key, group in groups.items():
        gw = f"{where}: config group '{key}'"
        require(isinstance(group, dict), f"{gw} is not an object")
        fmt = _string(group, "format", gw) if _present(group, "format") else top
        require(fmt != "", f"{gw} has no 'format' (nor has the quantization_config)")
        require(fmt == "float-quantized", f"{gw}: compressed-tensors format '{fmt}' is not supported (kvcc reads "
                "float-quantized)")
        if not _present(group, "weights"):
            continue  # activations only: the weights stay in float
        s = group["weights"]
        ww = f"{gw} weights"
        require(isinstance(s, dict), f"{ww} is not an object")
        require(s.get("type") == "float", f"{ww}: type must be \"float\", got "
                f"{json.dumps(s['type']) if _present(s, 'type') else 'none'}")
        require(s.get("num_bits") == 8 and not isinstance(s.get("num_bits"), bool),
                f"{ww}: num_bits must be 8 (FP8 E4M3), got "
                f"{json.dumps(s['num_bits']) if _present(s, 'num_bits') else 'none'}")
        require(not _present(s, "symmetric") or s["symmetric"] is True,
                f"{ww}: asymmetric weights (a zero point) are not supported")
        require(not _present(s, "dynamic") or s["dynamic"] is False, f"{ww}: dynamic weight scales are not supported")
        require(_present(s, "strategy"), f"{ww} lack 'strategy'")
        g = WeightQuantization(w.method, w.scale_suffix, _string(s, "strategy", ww))
        if g.strategy == "tensor":
            pass
        elif g.strategy == "channel":
            g.block_rows = 1
        elif g.strategy == "group":
            require(_present(s, "group_size"), f"{ww}: strategy group lacks 'group_size'")
            g.block_rows = 1
            g.block_cols = _positive_pair([1, s["group_size"]], f"{ww}: field 'group_size'")[1]
        elif g.strategy == "block":
            require(_present(s, "block_structure"), f"{ww}: strategy block lacks 'block_structure'")
            g.block_rows, g.block_cols = _positive_pair(s["block_structure"], f"{ww}: field 'block_structure'")
        else:
            raise KvccError(f"{ww}: strategy '{g.strategy}' is not supported (tensor, channel, group, block)")
        # Which module a group targets is not resolved: one weight scheme for the whole checkpoint.
        require(not w.strategy or (w.strategy, w.block_rows, w.block_cols) == (g.strategy, g.block_rows,
                                                                                  g.block_cols),
                f"{where}: config groups with different weight schemes ({w.strategy}, {g.strategy}) are not supported")
        w = g
    return w


def parse_weight_quantization(config: dict, where: str) -> WeightQuantization:
    """config.json's quantization_config (absent or null: method ""); unsupported methods and
    formats are refused by name."""
    if not _present(config, "quantization_config"):
        return WeightQuantization()
    q = config["quantization_config"]
    qw = f"{where}: quantization_config"
    require(isinstance(q, dict), f"{qw} must be an object")
    require(_present(q, "quant_method"), f"{qw} lacks 'quant_method'")
    method = _string(q, "quant_method", qw)
    if method == "fp8":
        return _parse_fp8(q, qw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q, qw)
    raise KvccError(f"{qw}: quant_method '{method}' is not supported (kvcc dequantizes fp8 and compressed-tensors "
                    "float-quantized checkpoints)")


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


@dataclass
class WeightScale:
    scale_name: str
    block_rows: int  # resolved: never 0
    block_cols: int
    grid: tuple  # (rows, cols) of the scale grid


def pair_weight_scales(q: WeightQuantization, entries: dict, where: str, read_tensor) -> dict:
    """weight name -> WeightScale for every F8_E4M3 tensor; read_tensor(name) gives a tensor's
    values (the scales are checked finite and non-negative). Refuses what
    formats/quantized_weights.cpp pair_weight_scales refuses."""
    import torch

    for name in sorted(entries):
        dtype = entries[name][0]
        require(dtype != "F8_E5M2", f"{where}: tensor {name} is F8_E5M2, which kvcc does not read (FP8 checkpoints "
                "store weights in F8_E4M3)")
        # A weight's scale is WEIGHT + suffix (activation scales such as X.input_scale are not).
        if not q.method or dtype == "F8_E4M3" or not name.endswith("weight" + q.scale_suffix):
            continue
        weight = name[:-len(q.scale_suffix)]
        other = entries.get(weight)
        require(other is not None and other[0] == "F8_E4M3", f"{where}: tensor {name} is a scale of {weight}, which "
                + ("is absent" if other is None else f"is {other[0]}, not F8_E4M3"))
    out = {}
    for name in sorted(entries):
        dtype, shape = entries[name][0], entries[name][1]
        if dtype != "F8_E4M3":
            continue
        tw = f"{where}: tensor {name}"
        require(bool(q.method), f"{tw} is F8_E4M3 but config.json has no quantization_config saying how it is scaled")
        require(bool(q.strategy), f"{tw} is F8_E4M3 but the quantization_config quantizes no weights")
        require(len(shape) == 2, f"{tw} is F8_E4M3 of shape {_shape_text(shape)}; only matrices are dequantized")
        scale_name = name + q.scale_suffix
        require(scale_name in entries, f"{tw} is F8_E4M3 but its scale {scale_name} is missing")
        sdtype, sshape = entries[scale_name][0], entries[scale_name][1]
        sw = f"{where}: scale {scale_name}"
        require(sdtype in FLOAT_DTYPES, f"{sw} has dtype {sdtype} (expected F32, BF16, F16 or F64)")
        rows, cols = int(shape[0]), int(shape[1])
        br = q.block_rows if q.block_rows > 0 else max(rows, 1)
        bc = q.block_cols if q.block_cols > 0 else max(cols, 1)
        grid = (-(-rows // br), -(-cols // bc))
        if q.strategy == "tensor":
            ok, expected = list(sshape) in ([], [1]), "[] or [1]"
        else:
            ok, expected = list(sshape) == list(grid), _shape_text(grid)
        scheme = f"{q.method} {q.strategy}" + (f" {q.block_rows}x{q.block_cols}" if q.strategy in ("block", "group")
                                               else "")
        require(ok, f"{sw} has shape {_shape_text(sshape)} but {scheme} scales of a {_shape_text(shape)} weight have "
                f"shape {expected}")
        values = read_tensor(scale_name).to(torch.float32).flatten()
        bad = (~torch.isfinite(values)) | (values < 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0].item())
            raise KvccError(f"{sw} holds {values[i].item():f} at element {i} (scales must be finite and non-negative)")
        out[name] = WeightScale(scale_name, br, bc, grid)
    return out


def dequantize(codes, scale, ws: WeightScale):
    """float32 `codes.float() * scale` with the scale grid expanded over its blocks."""
    import torch

    rows, cols = codes.shape
    grid = scale.to(torch.float32).reshape(ws.grid)
    expanded = grid.repeat_interleave(ws.block_rows, 0).repeat_interleave(ws.block_cols, 1)[:rows, :cols]
    return codes.to(torch.float32) * expanded


class _Dequantized:
    """A state-dict entry that dequantizes when transformers materializes it (tensor[...])."""

    def __init__(self, codes_file, scale_file, name: str, ws: WeightScale):
        self.codes_file, self.scale_file, self.name, self.ws = codes_file, scale_file, name, ws

    def __getitem__(self, index):
        codes = self.codes_file.get_tensor(self.name)
        return dequantize(codes, self.scale_file.get_tensor(self.ws.scale_name), self.ws)[index]


class QuantizedCheckpoint:
    """The dequantized state dict of an FP8 checkpoint (lazy: one tensor at a time, as transformers
    loads), and the safetensors handles it reads through (close() when the model is loaded)."""

    ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".output_scale")

    def __init__(self, model_dir: str, q: WeightQuantization):
        from safetensors import safe_open

        self.entries = weight_entries(model_dir)
        self.handles = {}

        def handle(path):
            if path not in self.handles:
                try:
                    self.handles[path] = safe_open(path, framework="pt", device="cpu")
                except Exception as e:  # safetensors raises its own error types
                    raise KvccError(f"{path}: cannot read ({e})") from None
            return self.handles[path]

        self.scales = pair_weight_scales(q, self.entries, model_dir, lambda n: handle(self.entries[n][2]).get_tensor(n))
        scale_names = {ws.scale_name for ws in self.scales.values()}
        self.state_dict = {}
        for name, (_, _, path) in self.entries.items():
            if name in scale_names or name.endswith(self.ACTIVATION_SCALES):
                continue
            if name in self.scales:
                ws = self.scales[name]
                self.state_dict[name] = _Dequantized(handle(path), handle(self.entries[ws.scale_name][2]), name, ws)
            else:
                self.state_dict[name] = handle(path).get_slice(name)

    def close(self):
        for h in self.handles.values():
            try:
                h.__exit__(None, None, None)
            except Exception:
                pass
        self.handles.clear()


def read_quantization(model_dir: str) -> WeightQuantization:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "r", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvccError(f"{path}: not valid JSON ({e})") from None
    return parse_weight_quantization(config, path)
