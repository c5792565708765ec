"""The package around the runtime: version, artifact description, zoo lookup, and clear errors
for bad input (paths, corrupt files, mismatched shapes, bad tensors, a full pool)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
h5py = pytest.importorskip("h5py")

import kvcc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ZOO = REPO / "zoo" / "published"
SHARED = Path(os.environ.get("KVCC_SHARED", REPO.parent / "shared"))
UNIFORM = sorted(glob.glob(str(ZOO / "stories260k" / "oscar-*" / "artifact.*.kvcc.h5")))[0]
GUT = sorted(glob.glob(str(ZOO / "gutenberg-27m" / "oscar-*" / "artifact.*.kvcc.h5")))[0]


def test_version_is_the_cmake_project_version():
    m = re.search(r"project\(\s*kvcc\s+VERSION\s+([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert m
    assert kvcc.__version__ == m.group(1)
    assert kvcc.library_version() == m.group(1)


@pytest.mark.parametrize("path", [UNIFORM, GUT])
def test_artifact_info_equals_the_file(path):
    info = kvcc.load_artifact(path)
    with h5py.File(path, "r") as f:  # read independently of libkvcc_c
        r, m = f["recipe"].attrs, f["model"].attrs
        assert info.method == r["method"]
        assert (info.key_bits, info.value_bits) == (float(r["key_bits"]), float(r["value_bits"]))
        assert (info.sink, info.recent, info.page_size) == (int(r["sink"]), int(r["recent"]), int(r["page_size"]))
        assert (info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (
            int(m["n_layers"]), int(m["n_heads"]), int(m["n_kv_heads"]), int(m["head_dim"]))
        assert info.group == (int(r["group"]) or int(m["head_dim"]))
        assert info.model["rope_style"] == m["rope_style"]
        clips = [float(f[f"layers/{L}/kv{h}/key"].attrs["clip_ratio"]) for L in range(info.n_layers)
                 for h in range(info.n_kv_heads)]
        assert info.raw["clip_ratio"]["key"] == [min(clips), max(clips)]
    index = json.loads((ZOO / "index.json").read_text())
    entry = next(e for e in index["entries"] if any(path.endswith(f["path"]) for f in e["files"]))
    assert info.model["model_id"] == entry["model_id"]
    assert info.model["fingerprint"]["id"] == entry["fingerprint"]["id"]
    assert info.path == os.path.abspath(path)


def test_artifact_cache_layout_from_the_recipe():
    """info.cache: the runtime's layout and whether it serves the artifact, against the recipe read
    with h5py (page bytes by docs/runtime.md's formula: P tokens x (2 x d/4 code bytes + 2 x d/G x 4
    parameter bytes) per layer and KV head)."""
    info = kvcc.load_artifact(GUT)
    c = info.cache
    assert c["served"] and c["refusal"] == "" and c["keys"] == "per_token" and c["key_group_tokens"] == 0
    assert c["key_pair_bytes"] == 0  # per-channel key pages only
    d, g, P = info.head_dim, info.group, info.page_size
    assert c["page_bytes"] == info.n_layers * info.n_kv_heads * P * (2 * (d // 4) + 2 * (d // g) * 4)
    assert c["slot_bytes"] == info.n_layers * info.n_kv_heads * (info.sink + info.recent) * d * 2 * 2
    turbo = sorted(glob.glob(str(ZOO / "gutenberg-27m" / "turboquant-*" / "artifact.*.kvcc.h5")))[0]
    t = kvcc.load_artifact(turbo).cache
    assert not t["served"] and "method 'turboquant'" in t["refusal"] and t["gpu_refusal"] == t["refusal"]


def test_zoo_find_by_model_id_and_method(monkeypatch):
    hits = kvcc.zoo.find(model="gutenberg-27m", zoo=ZOO)
    index = json.loads((ZOO / "index.json").read_text())
    assert [e.id for e in hits] == sorted(e["id"] for e in index["entries"] if e["model_id"] == "gutenberg-27m")
    oscar = kvcc.zoo.find(model="gutenberg-27m", method="oscar", zoo=ZOO, verify=True)
    assert len(oscar) == 1 and oscar[0].artifact_path == os.path.abspath(GUT)
    assert kvcc.zoo.find(model="no-such-model", zoo=ZOO) == []
    # the default zoo: $KVCC_ZOO, else zoo/published when kvcc runs from a checkout
    monkeypatch.setenv("KVCC_ZOO", str(ZOO))
    assert [e.id for e in kvcc.zoo.find(model="gutenberg-27m")] == [e.id for e in hits]
    monkeypatch.delenv("KVCC_ZOO")
    if Path(kvcc.__file__).resolve().is_relative_to(REPO / "python"):
        assert [e.id for e in kvcc.zoo.find(model="gutenberg-27m")] == [e.id for e in hits]
    else:  # an installed package has no default zoo
        with pytest.raises(kvcc.KvccError, match="KVCC_ZOO"):
            kvcc.zoo.find(model="gutenberg-27m")


def test_zoo_find_by_model_fingerprint():
    model = SHARED / "models" / "tinystories-656k"
    demo = REPO / "cli" / "demo" / "stories260k" / "stories260K.bin"
    hits = kvcc.zoo.find(model=str(demo), zoo=ZOO)  # a llama2.c checkpoint in the repository
    assert {e.model_id for e in hits} == {"stories260k"} and len(hits) >= 1
    if (model / "config.json").is_file():
        assert {e.model_id for e in kvcc.zoo.find(model=model, zoo=ZOO)} == {"tinystories-656k"}


def test_zoo_errors(tmp_path):
    with pytest.raises(kvcc.KvccError, match="index.json is missing"):
        kvcc.zoo.find(model="x", zoo=tmp_path)
    (tmp_path / "index.json").write_text('{"format": "other", "format_version": 1, "entries": []}')
    with pytest.raises(kvcc.KvccError, match="not a kvcc-zoo index"):
        kvcc.zoo.find(model="x", zoo=tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(kvcc.KvccError, match="cannot read zoo index"):
        kvcc.zoo.entries(tmp_path)
    index = json.loads((ZOO / "index.json").read_text())
    index["entries"][0]["files"][0]["path"] = "../../etc/passwd"
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(kvcc.KvccError, match="unsafe path"):
        kvcc.zoo.entries(tmp_path)
    # a corrupt artifact is caught by verify=True
    zoo2 = tmp_path / "zoo2"
    shutil.copytree(ZOO, zoo2)
    art = Path(kvcc.zoo.find(model="stories260k", method="oscar", zoo=zoo2)[0].artifact_path)
    data = bytearray(art.read_bytes())
    data[len(data) // 2] ^= 0xFF
    art.write_bytes(bytes(data))
    with pytest.raises(kvcc.KvccError, match="corrupt"):
        kvcc.zoo.find(model="stories260k", method="oscar", zoo=zoo2, verify=True)


def test_artifact_errors(tmp_path):
    with pytest.raises(kvcc.KvccError, match="no such artifact"):
        kvcc.load_artifact(tmp_path / "missing.kvcc.h5")
    with pytest.raises(kvcc.KvccError, match="directory"):
        kvcc.load_artifact(tmp_path)
    text = tmp_path / "text.kvcc.h5"
    text.write_text("not an artifact")
    with pytest.raises(kvcc.KvccError):
        kvcc.load_artifact(text)
    data = Path(UNIFORM).read_bytes()
    truncated = tmp_path / "truncated.kvcc.h5"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(kvcc.KvccError):
        kvcc.load_artifact(truncated)
    with pytest.raises(kvcc.KvccError):
        kvcc.Runtime(truncated, max_pages=1, max_sequences=1)
    # an edited rotation: the checksum of its dataset no longer matches
    edited = tmp_path / "edited.kvcc.h5"
    shutil.copy(UNIFORM, edited)
    with h5py.File(edited, "r+") as f:
        rot = f["layers/0/kv0/key/rotation"]
        r = rot[()]
        r[0, 0] += 1e-3
        rot[...] = r
    with pytest.raises(kvcc.KvccError, match="checksum"):
        kvcc.load_artifact(edited)


def test_runtime_argument_errors():
    info = kvcc.load_artifact(UNIFORM)
    with pytest.raises(kvcc.KvccError, match="n_heads|heads"):
        kvcc.Runtime(UNIFORM, n_heads=info.n_heads + 1, max_pages=1, max_sequences=1)
    with pytest.raises(kvcc.KvccError, match="head_dim"):
        kvcc.Runtime(UNIFORM, head_dim=2 * info.head_dim, max_pages=1, max_sequences=1)
    with pytest.raises(kvcc.KvccError, match="max_pages"):
        kvcc.Runtime(UNIFORM, max_pages=-1, max_sequences=1)
    with pytest.raises(kvcc.KvccError, match="max_sequences"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=0)
    with pytest.raises(kvcc.KvccError, match="int"):
        kvcc.Runtime(UNIFORM, max_pages=1.5, max_sequences=1)
    with pytest.raises(kvcc.KvccError, match="device"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(kvcc.KvccError, match="CUDA"):
            kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, device="cuda")
    with pytest.raises(kvcc.KvccError, match="divide|ranks"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, rank=0, ranks=3)
    with pytest.raises(kvcc.KvccError):
        kvcc.pages_for_tokens(info, -1)
    with pytest.raises(TypeError):
        kvcc.pages_for_tokens("not an artifact", 10)


def test_tensor_errors_and_cache_full():
    rt = kvcc.Runtime(UNIFORM, max_pages=0, max_sequences=1)
    H, Hq, d = rt.n_kv_heads, rt.n_heads, rt.head_dim
    s = rt.add_sequence()
    with pytest.raises(kvcc.CacheFull, match="sequence slots"):
        rt.add_sequence()
    good = torch.zeros(4, H, d)
    with pytest.raises(kvcc.KvccError, match="without an open step"):
        rt.append(0, good, good)
    rt.begin_append([s], [4])
    for bad, what in [
        (torch.zeros(4, H + 1, d), "shape"),
        (torch.zeros(3, H, d), "shape"),
        (torch.zeros(4, H, d, dtype=torch.int32), "floating"),
        (torch.full((4, H, d), float("nan")), "NaN"),
        (good.numpy(), "torch.Tensor"),
    ]:
        with pytest.raises(kvcc.KvccError, match=what):
            rt.append(0, bad, good)
    with pytest.raises(kvcc.KvccError, match="out of range"):
        rt.append(rt.n_layers, good, good)
    # The dispatcher gives meta tensors to the fake kernel, which checks shapes but not devices;
    # the real kernel's device check (a CPU runtime given CUDA tensors runs it) directly:
    with pytest.raises(kvcc.KvccError, match="is on meta"):
        rt._check_append(0, torch.zeros(4, H, d, device="meta"), good)
    with pytest.raises(kvcc.KvccError, match="shape"):
        rt.append(0, torch.zeros(4, H, 2 * d, device="meta"), torch.zeros(4, H, 2 * d, device="meta"))
    for L in range(rt.n_layers):
        rt.append(L, good, good)
    with pytest.raises(kvcc.KvccError, match="shape"):
        rt.decode(0, [s], torch.zeros(2, Hq, d))
    with pytest.raises(kvcc.KvccError, match="shape"):
        rt.decode(0, [s], torch.zeros(1, H, d))
    with pytest.raises(kvcc.KvccError):
        rt.decode(0, [s + 5], torch.zeros(1, Hq, d))  # no such sequence
    with pytest.raises(kvcc.KvccError, match="shape"):
        rt.prefill(0, s, torch.zeros(2, Hq, d), torch.zeros(3, H, d), torch.zeros(3, H, d))
    two = (torch.zeros(2, Hq, d), torch.zeros(2, H, d), torch.zeros(2, H, d))
    with pytest.raises(kvcc.KvccError, match="needs counts"):
        rt.prefill(0, [s, s + 1], *two)
    with pytest.raises(kvcc.KvccError, match="counts sum to 3"):
        rt.prefill(0, [s], *two, counts=[3])
    with pytest.raises(kvcc.KvccError, match="with 1 counts"):
        rt.prefill(0, [s, s + 1], *two, counts=[2])
    with pytest.raises(kvcc.KvccError, match="a sequence twice"):
        rt.prefill(0, [s, s], *two, counts=[1, 1])
    with pytest.raises(kvcc.KvccError, match=r"counts\[0\] must be >= 0"):
        rt.prefill(0, [s], *two, counts=[-1])
    with pytest.raises(kvcc.KvccError, match="listed twice"):
        rt.begin_append([s, s], [1, 1])
    with pytest.raises(kvcc.KvccError, match="counts"):
        rt.begin_append([s], [1, 2])
    # max_pages = 0: the windows (sink + recent) fill, then the first page cannot be had
    room = rt.info.sink + rt.info.recent - rt.length(s)
    rt.begin_append([s], [room])
    with pytest.raises(kvcc.CacheFull, match="out of pages"):
        rt.begin_append([s], [1])
    assert rt.length(s) == rt.info.sink + rt.info.recent
    # the refused step opened nothing, and the one before it is not resumed either
    with pytest.raises(kvcc.KvccError, match="without an open step"):
        rt.append(0, torch.zeros(room, H, d), torch.zeros(room, H, d))
    rt.close()
    with pytest.raises(kvcc.KvccError, match="closed"):
        rt.length(s)
    with pytest.raises(kvcc.KvccError, match="handle"):
        torch.ops.kvcc.decode(rt.handle, rt.state, 0, [s], torch.zeros(1, Hq, d))
    rt.close()  # twice is fine


def test_an_unreferenced_runtime_is_freed():
    import gc

    rt = kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1)
    handle = rt.handle
    assert kvcc.ops._runtimes.get(handle) is rt
    del rt
    gc.collect()
    assert kvcc.ops._runtimes.get(handle) is None  # the op registry does not keep it alive


def test_missing_library_is_a_clear_error(tmp_path):
    code = "import kvcc\ntry:\n    kvcc.load_artifact(%r)\nexcept kvcc.KvccError as e:\n    print('ERR', e)\n" % UNIFORM
    env = dict(os.environ, KVCC_LIBRARY=str(tmp_path / "nope.so"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "ERR cannot load libkvcc_c.so" in out and "nope.so (missing)" in out


def test_import_without_torch_or_library(tmp_path):
    # `import kvcc` and kvcc.zoo need neither torch nor the shared library
    code = ("import sys; sys.modules['torch'] = None\nimport kvcc, kvcc.zoo\n"
            "print(kvcc.__version__, len(kvcc.zoo.entries(%r)))\n" % str(ZOO))
    env = dict(os.environ, KVCC_LIBRARY=str(tmp_path / "nope.so"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == kvcc.__version__


def test_declared_maxima_refuse_larger_steps():
    rt = kvcc.Runtime(UNIFORM, max_pages=4, max_sequences=3, max_batch=2, max_context=100, max_step_tokens=50)
    a, b, c = rt.add_sequence(), rt.add_sequence(), rt.add_sequence()
    with pytest.raises(kvcc.KvccError, match="max_batch"):
        rt.begin_append([a, b, c], [1, 1, 1])
    with pytest.raises(kvcc.KvccError, match="max_step_tokens"):
        rt.begin_append([a, b], [30, 30])
    rt.begin_append([a, b], [50, 0])
    rt.begin_append([a], [50])
    with pytest.raises(kvcc.KvccError, match="max_context"):
        rt.begin_append([a], [1])
    assert rt.length(a) == 100
    with pytest.raises(kvcc.KvccError, match="max_context"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, max_batch=1)  # maxima need max_context
    with pytest.raises(kvcc.KvccError, match="max_step_tokens"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, max_context=10, max_step_tokens=-1)
