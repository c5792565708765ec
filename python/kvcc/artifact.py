"""Reading a compiled artifact's description (recipe, windows, shape, model metadata)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from . import _lib
from ._lib import KvccError

__all__ = ["ArtifactInfo", "load_artifact", "pages_for_tokens"]


@dataclass(frozen=True)
class ArtifactInfo:
    """What an artifact holds, as libkvcc_c's reader validated it (checksums, shapes, finiteness).

    model: what the artifact records about its model: model_id, n_heads, rope_style and the
    fingerprint (id, weights_sha256, fields). raw: the library's whole description.
    """

    path: str
    method: str
    key_bits: float
    value_bits: float
    sink: int
    recent: int
    page_size: int
    group: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    model: dict[str, Any] = field(repr=False)
    raw: dict[str, Any] = field(repr=False)

    @property
    def cache(self) -> dict[str, Any]:
        """How the runtime holds this artifact: served (bool), refusal and gpu_refusal ("" or why
        not), keys ("per_token", or "per_channel" for kivi's key pages), key_group_tokens,
        key_pair_bytes (per-channel keys: 4, fp16 pairs, or 2 with key_params=e5m3; else 0),
        value_group, page_bytes and slot_bytes (kvcc_artifact_describe's "cache")."""
        return self.raw["cache"]


def load_artifact(path: str | os.PathLike) -> ArtifactInfo:
    """Reads and validates the artifact at path; raises KvccError when it is missing or corrupt."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise KvccError(f"no such artifact: {p}")
    if os.path.isdir(p):
        raise KvccError(f"artifact path is a directory: {p}")
    raw = json.loads(_lib.call_json("kvcc_artifact_describe", p))
    r = raw["recipe"]
    model = {
        "model_id": raw["model_id"],
        "n_layers": raw["n_layers"],
        "n_heads": raw["n_heads"],
        "n_kv_heads": raw["n_kv_heads"],
        "head_dim": raw["head_dim"],
        "rope_style": raw["rope_style"],
        "fingerprint": raw["fingerprint"],
        "fields": dict(raw["fingerprint"]["fields"]),
    }
    return ArtifactInfo(
        path=os.path.abspath(p),
        method=r["method"],
        key_bits=float(r["key_bits"]),
        value_bits=float(r["value_bits"]),
        sink=int(r["sink"]),
        recent=int(r["recent"]),
        page_size=int(r["page_size"]),
        group=int(r["group"]) or int(raw["head_dim"]),
        n_layers=int(raw["n_layers"]),
        n_heads=int(raw["n_heads"]),
        n_kv_heads=int(raw["n_kv_heads"]),
        head_dim=int(raw["head_dim"]),
        model=model,
        raw=raw,
    )


def pages_for_tokens(info_or_runtime: Any, tokens: int) -> int:
    """INT2 history pages one sequence of `tokens` tokens holds (the runtime's max_pages is the
    sum over the sequences it serves at once). Takes an ArtifactInfo or a Runtime."""
    info = getattr(info_or_runtime, "info", info_or_runtime)
    if not isinstance(info, ArtifactInfo):
        raise TypeError("pages_for_tokens takes an ArtifactInfo (kvcc.load_artifact) or a kvcc.Runtime")
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    import ctypes

    out = ctypes.c_int64()
    _lib.check(_lib.lib().kvcc_history_pages(info.sink, info.recent, info.page_size, tokens, ctypes.byref(out)))
    return int(out.value)
