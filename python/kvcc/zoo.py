"""Looking up published artifacts in a kvcc zoo (docs/zoo.md: <zoo>/index.json, format kvcc-zoo 1).

    entry = kvcc.zoo.find(model="path/to/model_dir", method="oscar")[0]
    rt = kvcc.Runtime(entry.artifact_path, max_pages=..., max_sequences=...)

model is a model directory (or llama2.c .bin: matched by fingerprint, which needs libkvcc_c.so)
or a model id ("gutenberg-27m": matched by name). The zoo defaults to $KVCC_ZOO, else the
repository's zoo/published when kvcc runs from a checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._lib import KvccError

__all__ = ["ZooEntry", "default_zoo", "entries", "find"]

ZOO_FORMAT, ZOO_FORMAT_VERSION = "kvcc-zoo", 1


@dataclass(frozen=True)
class ZooEntry:
    id: str
    model_id: str
    recipe_tag: str
    method: str
    key_bits: float
    value_bits: float
    artifact_path: str  # absolute
    card_path: str | None
    fingerprint_id: str
    bits: dict[str, Any] = field(repr=False)
    validation: Any = field(repr=False)
    raw: dict[str, Any] = field(repr=False)


def default_zoo() -> Path:
    env = os.environ.get("KVCC_ZOO")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2] / "zoo" / "published"
    if (checkout / "index.json").is_file():
        return checkout
    raise KvccError("no zoo given: pass zoo=DIR or set KVCC_ZOO (the default zoo/published exists only in a checkout)")


def _safe_rel(zoo: Path, rel: str, entry_id: str) -> Path:
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        raise KvccError(f"zoo {zoo}: entry {entry_id} names an unsafe path {rel!r}")
    return zoo / p


def entries(zoo: str | os.PathLike | None = None) -> list[ZooEntry]:
    """Every entry of the zoo's index.json (checked as the C++ reader checks it)."""
    root = Path(zoo) if zoo is not None else default_zoo()
    index = root / "index.json"
    try:
        doc = json.loads(index.read_text())
    except FileNotFoundError:
        raise KvccError(f"not a kvcc zoo: {index} is missing") from None
    except (OSError, ValueError) as e:
        raise KvccError(f"cannot read zoo index {index}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != ZOO_FORMAT or doc.get("format_version") != ZOO_FORMAT_VERSION:
        raise KvccError(f"{index}: not a {ZOO_FORMAT} index of version {ZOO_FORMAT_VERSION}")
    out, seen = [], set()
    for e in doc.get("entries", []):
        try:
            eid, model_id, tag = e["id"], e["model_id"], e["recipe_tag"]
            if eid != f"{model_id}/{tag}":
                raise KvccError(f"{index}: entry id {eid!r} is not model_id/recipe_tag")
            if eid in seen:
                raise KvccError(f"{index}: duplicate entry id {eid!r}")
            seen.add(eid)
            files = {f["role"]: _safe_rel(root, f["path"], eid) for f in e["files"]}
            if "artifact" not in files:
                raise KvccError(f"{index}: entry {eid} lists no artifact file")
            out.append(
                ZooEntry(
                    id=eid, model_id=model_id, recipe_tag=tag, method=e["recipe"]["method"],
                    key_bits=float(e["recipe"]["key_bits"]), value_bits=float(e["recipe"]["value_bits"]),
                    artifact_path=str(files["artifact"].resolve()),
                    card_path=str(files["card"].resolve()) if "card" in files else None,
                    fingerprint_id=e["fingerprint"]["id"], bits=e.get("bits", {}), validation=e.get("validation"),
                    raw=e,
                )
            )
        except (KeyError, TypeError) as err:
            raise KvccError(f"{index}: malformed entry {e.get('id', '?') if isinstance(e, dict) else e!r}: "
                            f"missing or bad {err}") from None
    return out


def _is_model_path(model: str) -> bool:
    return os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".bin"))


def find(model: str | os.PathLike, method: str | None = None, zoo: str | os.PathLike | None = None,
         verify: bool = False) -> list[ZooEntry]:
    """Entries for a model (a model directory / .bin by fingerprint, or a model id by name), of
    `method` when given, sorted by id. verify=True re-hashes each returned artifact (sha256)."""
    m = os.fspath(model)
    all_entries = entries(zoo)
    if _is_model_path(m):
        from . import _lib

        fp = json.loads(_lib.call_json("kvcc_model_fingerprint", m))
        hits = [e for e in all_entries if e.fingerprint_id == fp["id"]]
    else:
        hits = [e for e in all_entries if e.model_id == m]
    if method is not None:
        hits = [e for e in hits if e.method == method]
    hits.sort(key=lambda e: e.id)
    if verify:
        for e in hits:
            _verify(e)
    return hits


def _verify(e: ZooEntry) -> None:
    f = next(f for f in e.raw["files"] if f["role"] == "artifact")
    p = Path(e.artifact_path)
    if not p.is_file():
        raise KvccError(f"zoo entry {e.id}: artifact {p} is missing")
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != f["sha256"]:
        raise KvccError(f"zoo entry {e.id}: artifact {p} is corrupt (sha256 differs from the index)")
