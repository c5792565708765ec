"""The kvcc-stats v1 file (docs/formats.md) from Python: the model description kvcc records
(ModelConfig and fingerprint, ported from formats/hf_config.cpp, formats/model_config.cpp and
formats/model_file.cpp so that both producers give the same model identity) and an atomic h5py
writer of the schema that formats/stats.cpp reads.

Needs numpy and h5py only (no torch), so the format can be checked without a model.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field

import numpy as np

STATS_FORMAT = "kvcc-stats"
STATS_VERSION = "1.2"  # 1.1: attribute checksums (attributes_digest); 1.2: the optional /sensitivity group (not written here)
ATTRIBUTES_CHECKSUM = "attributes_sha256"

# HF architectures the C++ reader knows (formats/hf_config.cpp kArchitectures): (class, model_type, name).
_ARCHITECTURES = (
    ("LlamaForCausalLM", "llama", "llama"),
    ("MistralForCausalLM", "mistral", "mistral"),
    ("Qwen2ForCausalLM", "qwen2", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3", "qwen3"),
)


class KvccError(Exception):
    """A bad input or a refused model, with a one-line message naming what is wrong."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise KvccError(message)


@dataclass
class ModelConfig:
    """formats/model_config.h ModelConfig, field for field."""

    architecture: str = ""
    n_layers: int = 0
    hidden: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    vocab: int = 0
    max_position: int = 0
    rope_theta: float = 10000.0
    rope_scaling_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position: int = 8192
    rope_style: str = "rotate_half"
    rms_eps: float = 1e-5
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_id: int = -1
    eos_id: int = -1
    add_bos: bool = True
    # Not part of the C++ config: whether the architecture is one the C++ reader also reads.
    known_architecture: bool = field(default=True, compare=False)

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


# ---------------------------------------------------------------------------------------------
# config.json (port of formats/hf_config.cpp)


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvccError(f"{path}: not valid JSON ({e})") from None


def _present(j, key) -> bool:
    return isinstance(j, dict) and key in j and j[key] is not None


def _int32(v, where: str, minimum: int = -(2**31)) -> int:
    require(isinstance(v, int) and not isinstance(v, bool), f"{where} must be an integer, got {json.dumps(v)}")
    require(minimum <= v <= 2**31 - 1, f"{where} = {v} is out of range (want {minimum} .. {2**31 - 1})")
    return v


def _required_int(j, key, where):
    require(_present(j, key), f"{where}: missing field '{key}'")
    return _int32(j[key], f"{where}: field '{key}'", 1)


def _optional_int(j, key, fallback, where):
    return _int32(j[key], f"{where}: field '{key}'") if _present(j, key) else fallback


def _optional_number(j, key, fallback, where):
    if not _present(j, key):
        return float(fallback)
    v = j[key]
    require(isinstance(v, (int, float)) and not isinstance(v, bool), f"{where}: field '{key}' must be a number")
    v = float(v)
    require(math.isfinite(v), f"{where}: field '{key}' must be finite, got {json.dumps(j[key])}")
    return v


def _optional_bool(j, key, fallback, where):
    if not _present(j, key):
        return fallback
    require(isinstance(j[key], bool), f"{where}: field '{key}' must be true or false")
    return j[key]


def _token_id(j, key, where):
    if not _present(j, key):
        return None
    v = j[key]
    if isinstance(v, int) and not isinstance(v, bool):
        return _int32(v, f"{where}: field '{key}'")
    if isinstance(v, list) and v and isinstance(v[0], int) and not isinstance(v[0], bool):
        return _int32(v[0], f"{where}: field '{key}'")
    return None


def _architecture_of(config, where, allow_unknown: bool):
    if _present(config, "architectures") and isinstance(config["architectures"], list) and config["architectures"] \
            and isinstance(config["architectures"][0], str):
        declared = config["architectures"][0]
        for cls, _, name in _ARCHITECTURES:
            if declared == cls:
                return name, True
    elif _present(config, "model_type") and isinstance(config["model_type"], str):
        declared = config["model_type"]
        for _, model_type, name in _ARCHITECTURES:
            if declared == model_type:
                return name, True
    else:
        raise KvccError(f"{where}: missing field 'architectures' (and 'model_type')")
    if allow_unknown:
        # Any architecture transformers runs: its model_type names it (the C++ reader refuses it).
        mt = config.get("model_type") if isinstance(config.get("model_type"), str) else declared
        return mt, False
    raise KvccError(f"{where}: unknown architecture '{declared}' (supported: LlamaForCausalLM, "
                    "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)")


def _parse_rope(config, where, cfg: ModelConfig) -> None:
    scaling = None
    if _present(config, "rope_parameters"):
        params = config["rope_parameters"]
        require(isinstance(params, dict), f"{where}: rope_parameters must be an object")
        cfg.rope_theta = _optional_number(params, "rope_theta", _optional_number(config, "rope_theta", 10000.0, where),
                                          where)
        scaling = params
    else:
        cfg.rope_theta = _optional_number(config, "rope_theta", 10000.0, where)
        if _present(config, "rope_scaling"):
            require(isinstance(config["rope_scaling"], dict), f"{where}: rope_scaling must be an object or null")
            scaling = config["rope_scaling"]
    require(cfg.rope_theta > 0, f"{where}: field 'rope_theta' must be positive, got {cfg.rope_theta:f}")
    if scaling is None:
        return
    rtype = "default"
    for key in ("rope_type", "type"):
        if _present(scaling, key) and isinstance(scaling[key], str):
            rtype = scaling[key]
            break
    if rtype == "default":
        return
    require(rtype == "llama3", f"{where}: unsupported rope scaling type '{rtype}' (supported: default, llama3)")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        require(_present(scaling, key), f"{where}: llama3 rope scaling lacks '{key}'")
    cfg.rope_scaling_type = "llama3"
    cfg.rope_scaling_factor = _optional_number(scaling, "factor", 1.0, where)
    cfg.rope_scaling_low_freq_factor = _optional_number(scaling, "low_freq_factor", 1.0, where)
    cfg.rope_scaling_high_freq_factor = _optional_number(scaling, "high_freq_factor", 4.0, where)
    cfg.rope_scaling_original_max_position = _optional_int(scaling, "original_max_position_embeddings", 8192, where)
    require(cfg.rope_scaling_factor > 0 and cfg.rope_scaling_low_freq_factor > 0
            and cfg.rope_scaling_high_freq_factor > cfg.rope_scaling_low_freq_factor
            and cfg.rope_scaling_original_max_position > 0, f"{where}: llama3 rope scaling fields out of range")


def _tokenizer_json_adds_bos(tok) -> bool:
    if not _present(tok, "post_processor"):
        return False
    pp = tok["post_processor"]
    processors = [pp] + (list(pp["processors"]) if _present(pp, "processors") else [])
    for p in processors:
        if not isinstance(p, dict) or not _present(p, "type"):
            continue
        if p["type"] == "TemplateProcessing" and _present(p, "single") and isinstance(p["single"], list) \
                and p["single"]:
            return isinstance(p["single"][0], dict) and "SpecialToken" in p["single"][0]
    return False


def _added_token_id(tok, content, where):
    if not _present(tok, "added_tokens") or not isinstance(tok["added_tokens"], list):
        return None
    for t in tok["added_tokens"]:
        if isinstance(t, dict) and t.get("content") == content and isinstance(t.get("id"), int):
            return _int32(t["id"], f"{where}: the id of added token \"{content}\"", 0)
    return None


def _token_text(tc, key):
    if not _present(tc, key):
        return None
    v = tc[key]
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def read_model_config(model_dir: str, allow_unknown: bool = True) -> ModelConfig:
    """formats/hf_config.cpp read_hf_config. Architectures the C++ reader does not know are read
    with the same field rules when allow_unknown (architecture = model_type, qkv_bias from
    attention_bias, qk_norm decided by the caller from the modules)."""
    require(os.path.isdir(model_dir), f"model path {model_dir} does not exist or is not a directory "
            "(the PyTorch producer reads Hugging Face model directories)")
    config_path = os.path.join(model_dir, "config.json")
    config = _read_json(config_path)
    require(config is not None, f"{model_dir}: no config.json (not a Hugging Face model directory)")
    where = config_path
    require(isinstance(config, dict), f"{where}: not a JSON object")
    cfg = ModelConfig()
    cfg.architecture, cfg.known_architecture = _architecture_of(config, where, allow_unknown)
    cfg.hidden = _required_int(config, "hidden_size", where)
    cfg.n_layers = _required_int(config, "num_hidden_layers", where)
    cfg.n_heads = _required_int(config, "num_attention_heads", where)
    cfg.intermediate = _required_int(config, "intermediate_size", where)
    cfg.vocab = _required_int(config, "vocab_size", where)
    cfg.n_kv_heads = _optional_int(config, "num_key_value_heads", cfg.n_heads, where)
    require(cfg.n_kv_heads > 0 and cfg.n_heads % cfg.n_kv_heads == 0,
            f"{where}: num_attention_heads {cfg.n_heads} is not a multiple of num_key_value_heads {cfg.n_kv_heads}")
    require(cfg.hidden % cfg.n_heads == 0 or _present(config, "head_dim"),
            f"{where}: hidden_size is not a multiple of num_attention_heads and head_dim is absent")
    cfg.head_dim = _optional_int(config, "head_dim", cfg.hidden // cfg.n_heads, where)
    require(cfg.head_dim > 0 and cfg.head_dim % 2 == 0, f"{where}: head_dim must be positive and even")
    cfg.max_position = _optional_int(config, "max_position_embeddings", 2048, where)
    cfg.rms_eps = _optional_number(config, "rms_norm_eps", 1e-6, where)
    require(cfg.rms_eps >= 0, f"{where}: field 'rms_norm_eps' must not be negative, got {cfg.rms_eps:f}")
    cfg.tied_embeddings = _optional_bool(config, "tie_word_embeddings", False, where)
    cfg.rope_style = "rotate_half"
    _parse_rope(config, where, cfg)
    if cfg.known_architecture:
        act = config["hidden_act"] if _present(config, "hidden_act") and isinstance(config["hidden_act"], str) \
            else "silu"
        require(act == "silu", f"{where}: unsupported hidden_act '{act}' (only silu)")
        require(not _optional_bool(config, "mlp_bias", False, where), f"{where}: mlp_bias is not supported")
        if cfg.architecture == "qwen2":
            cfg.qkv_bias = True
        else:
            require(not _optional_bool(config, "attention_bias", False, where),
                    f"{where}: attention_bias (with an o_proj bias) is not supported for {cfg.architecture}")
        cfg.qk_norm = cfg.architecture == "qwen3"
        # Qwen's use_sliding_window, which the C++ reader refuses, is read: the producer applies each
        # layer's window as the model does.
        _optional_bool(config, "use_sliding_window", False, where)
    else:
        cfg.qkv_bias = bool(config.get("attention_bias", False))
    cfg.bos_id = _token_id(config, "bos_token_id", where)
    cfg.eos_id = _token_id(config, "eos_token_id", where)
    cfg.bos_id = -1 if cfg.bos_id is None else cfg.bos_id
    cfg.eos_id = -1 if cfg.eos_id is None else cfg.eos_id

    generation = _read_json(os.path.join(model_dir, "generation_config.json"))
    tokenizer_config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    tokenizer = _read_json(os.path.join(model_dir, "tokenizer.json"))
    if generation is not None:
        gw = os.path.join(model_dir, "generation_config.json")
        if cfg.bos_id < 0:
            v = _token_id(generation, "bos_token_id", gw)
            cfg.bos_id = -1 if v is None else v
        if cfg.eos_id < 0:
            v = _token_id(generation, "eos_token_id", gw)
            cfg.eos_id = -1 if v is None else v
    if tokenizer_config is not None and tokenizer is not None:
        tw = os.path.join(model_dir, "tokenizer.json")
        text = _token_text(tokenizer_config, "bos_token")
        if text is not None and cfg.bos_id < 0:
            v = _added_token_id(tokenizer, text, tw)
            cfg.bos_id = -1 if v is None else v
        text = _token_text(tokenizer_config, "eos_token")
        if text is not None and cfg.eos_id < 0:
            v = _added_token_id(tokenizer, text, tw)
            cfg.eos_id = -1 if v is None else v
    # Qwen tokenizers add no BOS although config.json names one; Llama ones do.
    add_bos = cfg.architecture not in ("qwen2", "qwen3")
    if tokenizer_config is not None and isinstance(tokenizer_config.get("add_bos_token"), bool):
        add_bos = tokenizer_config["add_bos_token"]
    elif tokenizer is not None:
        add_bos = _tokenizer_json_adds_bos(tokenizer)
    cfg.add_bos = add_bos and cfg.bos_id >= 0
    return cfg


# ---------------------------------------------------------------------------------------------
# Fingerprint (port of formats/model_config.cpp and formats/model_file.cpp)


def canonical_double(v: float) -> str:
    """C++ std::to_chars: whole numbers below 1e15 in plain digits; otherwise the shortest
    round-trip digits, in fixed or scientific notation, whichever is shorter (fixed on a tie)."""
    v = float(v)
    if math.isfinite(v) and v == math.floor(v) and abs(v) < 1e15:
        return ("-" if math.copysign(1.0, v) < 0 else "") + str(int(abs(v)))
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    sign, digits, exp = decimal.Decimal(repr(v)).normalize().as_tuple()
    ds = "".join(map(str, digits))
    n = len(ds)
    point = n + exp  # position of the decimal point relative to the digit string
    if point <= 0:
        fixed = "0." + "0" * (-point) + ds
    elif point >= n:
        fixed = ds + "0" * (point - n)
    else:
        fixed = ds[:point] + "." + ds[point:]
    e10 = point - 1
    mant = ds[0] + ("." + ds[1:] if n > 1 else "")
    sci = f"{mant}e{'-' if e10 < 0 else '+'}{abs(e10):02d}"
    s = fixed if len(fixed) <= len(sci) else sci
    return ("-" if sign else "") + s


def fingerprint_fields(c: ModelConfig) -> list[tuple[str, str]]:
    b = lambda x: "true" if x else "false"  # noqa: E731
    return [
        ("architecture", c.architecture),
        ("n_layers", str(c.n_layers)),
        ("hidden", str(c.hidden)),
        ("n_heads", str(c.n_heads)),
        ("n_kv_heads", str(c.n_kv_heads)),
        ("head_dim", str(c.head_dim)),
        ("intermediate", str(c.intermediate)),
        ("vocab", str(c.vocab)),
        ("rope_theta", canonical_double(c.rope_theta)),
        ("rope_scaling.type", c.rope_scaling_type),
        ("rope_scaling.factor", canonical_double(c.rope_scaling_factor)),
        ("rope_scaling.low_freq_factor", canonical_double(c.rope_scaling_low_freq_factor)),
        ("rope_scaling.high_freq_factor", canonical_double(c.rope_scaling_high_freq_factor)),
        ("rope_scaling.original_max_position", str(c.rope_scaling_original_max_position)),
        ("rope_style", c.rope_style),
        ("rms_eps", canonical_double(c.rms_eps)),
        ("tied_embeddings", b(c.tied_embeddings)),
        ("qkv_bias", b(c.qkv_bias)),
        ("qk_norm", b(c.qk_norm)),
    ]


def fingerprint_id(fields, weights_sha256: str) -> str:
    h = hashlib.sha256()
    for name, value in fields:
        h.update(f"{name}={value}\n".encode())
    h.update(f"weights_sha256={weights_sha256}\n".encode())
    return h.hexdigest()


def _safetensors_header(path: str) -> dict:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            require(len(raw) == 8, f"{path}: truncated safetensors file ({size} bytes, shorter than the 8-byte "
                    "header length)")
            (n,) = struct.unpack("<Q", raw)
            require(n <= size - 8, f"{path}: safetensors header length {n} exceeds the file size {size} "
                    "(truncated or not safetensors)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise KvccError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvccError(f"{path}: safetensors header is not valid JSON ({e})") from None
    require(isinstance(header, dict), f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def weight_headers(model_dir: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of the tensors the model directory declares, as ModelFile reads them:
    the index's weight_map when there is one (each tensor from its named shard), else model.safetensors."""
    return {name: (dtype, shape) for name, (dtype, shape, _) in weight_entries(model_dir).items()}


def weight_entries(model_dir: str) -> dict[str, tuple[str, list[int], str]]:
    """name -> (dtype, shape, the safetensors file holding it), as weight_headers."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    out: dict[str, tuple[str, list[int], str]] = {}
    if os.path.exists(index_path):
        index = _read_json(index_path)
        require(isinstance(index, dict) and isinstance(index.get("weight_map"), dict),
                f"{index_path}: missing field 'weight_map'")
        shards: dict[str, dict] = {}
        for name, shard in index["weight_map"].items():
            require(isinstance(shard, str), f"{index_path}: weight_map entry {name} is not a file name")
            require("/" not in shard, f"{index_path}: shard name '{shard}' is not a plain file name")
            if shard not in shards:
                sp = os.path.join(model_dir, shard)
                require(os.path.exists(sp), f"{index_path} names shard {shard}, which does not exist")
                shards[shard] = _safetensors_header(sp)
            entry = shards[shard].get(name)
            require(entry is not None, f"{index_path} places tensor {name} in {shard}, which lacks it")
            out[name] = (entry["dtype"], list(entry["shape"]), os.path.join(model_dir, shard))
        return out
    require(os.path.exists(single), f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    for name, entry in _safetensors_header(single).items():
        require(isinstance(entry, dict) and "dtype" in entry and "shape" in entry,
                f"{single}: tensor {name} lacks dtype or shape")
        out[name] = (entry["dtype"], list(entry["shape"]), single)
    return out


def weights_sha256(headers: dict[str, tuple[str, list[int]]]) -> str:
    h = hashlib.sha256()
    for name in sorted(headers):  # code-point order of str == byte order of UTF-8, as std::map sorts
        dtype, shape = headers[name]
        h.update(f"{name}\t{dtype}\t{','.join(str(int(s)) for s in shape)}\n".encode())
    return h.hexdigest()


@dataclass
class Fingerprint:
    fields: list
    weights_sha256: str
    id: str


def make_fingerprint(c: ModelConfig, weights_hex: str) -> Fingerprint:
    fields = fingerprint_fields(c)
    return Fingerprint(fields, weights_hex, fingerprint_id(fields, weights_hex))


# ---------------------------------------------------------------------------------------------
# Writer


def utc_now_iso8601() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _i64(x) -> np.int64:
    return np.int64(int(x))


def attributes_digest(obj) -> str:
    """sha256 hex of an HDF5 object's attributes but ATTRIBUTES_CHECKSUM, as formats/h5.cpp's
    Object::attributes_digest: by name (byte order), each `len:name` then `len:` and its kind and
    value (s + the UTF-8 string, i / u + the integer in decimal, f + the float64's bits in 16
    lowercase hex digits)."""
    text = b""
    for name in sorted(obj.attrs.keys(), key=lambda n: n.encode()):
        if name == ATTRIBUTES_CHECKSUM:
            continue
        v = obj.attrs[name]
        if isinstance(v, bytes):
            value = b"s" + v
        elif isinstance(v, str):
            value = b"s" + v.encode()
        elif isinstance(v, (float, np.floating)):
            value = b"f" + format(struct.unpack("<Q", struct.pack("<d", float(v)))[0], "016x").encode()
        elif isinstance(v, np.unsignedinteger):
            value = b"u" + str(int(v)).encode()
        elif isinstance(v, (int, np.signedinteger)):
            value = b"i" + str(int(v)).encode()
        else:
            raise KvccError(f"attribute {name} of {obj.name} has a type kvcc does not store ({type(v).__name__})")
        key = name.encode()
        text += str(len(key)).encode() + b":" + key + str(len(value)).encode() + b":" + value
    return hashlib.sha256(text).hexdigest()


def seal_attributes(group) -> None:
    """Writes ATTRIBUTES_CHECKSUM on every object under an h5py group (itself included) that has
    attributes: a writer's last step (formats/h5.h seal_attributes)."""
    import h5py

    for name in group:
        x = group[name]
        if isinstance(x, h5py.Group):
            seal_attributes(x)
        elif len(x.attrs):
            x.attrs[ATTRIBUTES_CHECKSUM] = attributes_digest(x)
    if any(k != ATTRIBUTES_CHECKSUM for k in group.attrs.keys()):
        group.attrs[ATTRIBUTES_CHECKSUM] = attributes_digest(group)


def write_stats(path: str, *, producer: str, command: str, config: ModelConfig, fingerprint: Fingerprint,
                provenance: dict, heads: list[list[dict]], reservoirs: list[list[dict]], capacity: int) -> None:
    """Writes the kvcc-stats 1.2 file atomically (PATH.tmp-XXXXXX in the same directory, renamed over
    PATH; removed on any error). heads[l][h]: query_m2, output_m2, p2_m2, key_m2, value_m2 ([d, d]
    float64, symmetric), key_min/key_max/value_min/value_max ([d] float64), query_count,
    output_count, kv_count (int), p2_weight (float). reservoirs[l][h]: q [n, r, d], key_pre, key,
    value [n, d] (float32), position (int32), doc (uint32), priority (uint64), heldout (uint8)."""
    import h5py

    d, r = config.head_dim, config.group
    target_dir = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(target_dir), f"output directory '{os.path.dirname(path) or '.'}' does not exist")
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=target_dir)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = STATS_FORMAT
            f.attrs["format_version"] = STATS_VERSION
            f.attrs["producer"] = producer
            f.attrs["created"] = utc_now_iso8601()
            f.attrs["command"] = command
            m = f.create_group("model")
            for name in ("architecture", "rope_scaling_type", "rope_style"):
                m.attrs[name] = getattr(config, name)
            for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab",
                         "max_position", "rope_scaling_original_max_position", "bos_id", "eos_id"):
                m.attrs[name] = _i64(getattr(config, name))
            for name in ("rope_theta", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                         "rope_scaling_high_freq_factor", "rms_eps"):
                m.attrs[name] = np.float64(getattr(config, name))
            for name in ("tied_embeddings", "qkv_bias", "qk_norm", "add_bos"):
                m.attrs[name] = _i64(1 if getattr(config, name) else 0)
            fp = m.create_group("fingerprint")
            fp.attrs["id"] = fingerprint.id
            fp.attrs["weights_sha256"] = fingerprint.weights_sha256
            for name, value in fingerprint.fields:
                fp.attrs[name] = value
            fp.attrs["fields"] = ",".join(name for name, _ in fingerprint.fields)
            p = f.create_group("provenance")
            p.attrs["data_sha256"] = provenance["data_sha256"]
            p.attrs["tokens"] = np.uint64(provenance["tokens"])
            p.attrs["sequences"] = np.uint64(provenance["sequences"])
            p.attrs["seed"] = np.uint64(provenance["seed"])
            p.attrs["max_seq_len"] = _i64(provenance["max_seq_len"])
            p.attrs["tokenizer"] = provenance["tokenizer"]
            layers = f.create_group("layers")
            for layer in range(config.n_layers):
                lg = layers.create_group(str(layer))
                for h in range(config.n_kv_heads):
                    hs = heads[layer][h]
                    g = lg.create_group(f"kv{h}")
                    for name in ("query_m2", "output_m2", "p2_m2", "key_m2", "value_m2"):
                        a = np.ascontiguousarray(hs[name], dtype="<f8")
                        require(a.shape == (d, d), f"internal: {name} has shape {a.shape}")
                        g.create_dataset(name, data=a)
                    for name in ("key_min", "key_max", "value_min", "value_max"):
                        g.create_dataset(name, data=np.ascontiguousarray(hs[name], dtype="<f8").reshape(d))
                    for name in ("query_count", "output_count", "kv_count"):
                        g.attrs[name] = np.uint64(hs[name])
                    g.attrs["p2_weight"] = np.float64(hs["p2_weight"])
                    res = reservoirs[layer][h]
                    rg = g.create_group("reservoir")
                    rg.attrs["capacity"] = _i64(capacity)
                    rg.attrs["group"] = _i64(r)
                    rg.attrs["d"] = _i64(d)
                    n = len(res["position"])
                    rg.create_dataset("q", data=np.asarray(res["q"], dtype="<f4").reshape(n, r, d))
                    for name in ("key_pre", "key", "value"):
                        rg.create_dataset(name, data=np.asarray(res[name], dtype="<f4").reshape(n, d))
                    rg.create_dataset("position", data=np.asarray(res["position"], dtype="<i4").reshape(n))
                    rg.create_dataset("doc", data=np.asarray(res["doc"], dtype="<u4").reshape(n))
                    rg.create_dataset("priority", data=np.asarray(res["priority"], dtype="<u8").reshape(n))
                    rg.create_dataset("heldout", data=np.asarray(res["heldout"], dtype="u1").reshape(n))
            seal_attributes(f)
            f.flush()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        umask = os.umask(0)  # mkstemp makes 0600; give the file the mode a plain create would
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
