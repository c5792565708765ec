"""python -m kvcc.generate (and a CPU smoke run of python -m kvcc.bench_generate's parts)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVCC_SHARED", REPO.parent / "shared"))
MODEL = SHARED / "models" / "gutenberg-27m"
PROMPT = "It was a dark and stormy night, and the wind"


def _artifact(model: str) -> str:
    found = sorted(glob.glob(str(REPO / "zoo" / "published" / model / "oscar-*" / "artifact.*.kvcc.h5")))
    if not found:
        pytest.skip(f"no published oscar artifact for {model}")
    return found[0]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The same kvcc package this process imports (installed, or the source tree on PYTHONPATH).
    import kvcc

    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvcc.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvcc.generate", *args], capture_output=True, text=True, env=env,
                          timeout=600)


needs_model = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"{MODEL} is absent")


def test_help_explains_the_command():
    r = _run("--help")
    assert r.returncode == 0
    for words in ("--artifact", "--max-new-tokens", "greedily", "INT2", "transformers' own cache", "examples:"):
        assert words in r.stdout


def test_negative_token_count_is_refused():
    r = _run("--model", str(MODEL), "--prompt", "x", "--max-new-tokens", "-3")
    assert r.returncode == 2 and "must be >= 0, got -3" in r.stderr


def test_missing_model_dir_is_refused(tmp_path):
    r = _run("--model", str(tmp_path / "nope"), "--prompt", "x", "--max-new-tokens", "3")
    assert r.returncode == 1 and "no such model directory" in r.stderr


@needs_model
def test_artifact_for_another_model_is_refused():
    r = _run("--model", str(MODEL), "--artifact", _artifact("tinystories-656k"), "--prompt", "x",
             "--max-new-tokens", "3")
    assert r.returncode == 1 and "compiled for another model" in r.stderr


@needs_model
def test_continuation_is_the_kvcc_greedy_one():
    import kvcc.hf as khf
    from transformers import AutoTokenizer

    artifact = _artifact("gutenberg-27m")
    r = _run("--model", str(MODEL), "--artifact", artifact, "--prompt", PROMPT, "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "12 generated" in r.stderr and "kvcc INT2" in r.stderr
    # The same greedy run in this process, through the library.
    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    model = khf.from_pretrained(MODEL, artifact=artifact)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert r.stdout == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"


@needs_model
def test_bench_generate_cpu_smoke(tmp_path):
    """python -m kvcc.bench_generate's measuring loop on the CPU (the GPU run is the real one)."""
    import json

    artifact = _artifact("gutenberg-27m")
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    import kvcc

    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvcc.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "kvcc.bench_generate", "--device", "cpu", "--models", "gutenberg",
                        "--gutenberg", str(MODEL), "--gutenberg-artifact", artifact, "--gutenberg-context", "100",
                        "--decode-steps", "2", "--no-capacity", "--caches", "bf16,int2,hqq2", "--json", str(out)],
                       capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    runs = {run["cache"]: run for run in res["runs"]}
    assert set(runs) == {"bf16", "int2", "hqq2"}
    info = kvcc.load_artifact(artifact)
    for run in runs.values():
        assert "error" not in run
        assert run["ttft_s"] > 0 and run["tpot_s"] > 0 and run["fill"] == "prefill"
        assert run["length_after"] == 100 + 2  # the prompt and both decode steps (the first step's token too)
        assert run["tokens_per_s"] == pytest.approx(1 / run["tpot_s"])
    heads = info.n_layers * info.n_kv_heads
    # 102 tokens: all in the BF16 windows, so the INT2 pool holds one window slot per row and no page.
    assert runs["int2"]["cache_bytes_in_use"] == heads * (info.sink + info.recent) * info.head_dim * 2 * 2
    assert runs["bf16"]["cache_bytes_in_use"] == heads * 102 * info.head_dim * 2 * 2
    # transformers' 2-bit cache: 2 bits per element at least, plus a scale and zero per group of 64
    # and the BF16 residual; a cache holding 4 or more bits per element is not what was asked for.
    assert runs["bf16"]["cache_bytes_in_use"] * 2 / 16 <= runs["hqq2"]["cache_bytes_in_use"]
    assert runs["hqq2"]["cache_bytes_in_use"] < runs["bf16"]["cache_bytes_in_use"] * 4 / 16
    # The bytes a step reads at least: the same weights for every cache, plus the cache in use.
    weights = {run["read_bytes_per_step"] - run["cache_bytes_in_use"] for run in runs.values()}
    assert len(weights) == 1 and weights.pop() > 0
    for run in runs.values():
        assert run["read_bytes_per_s"] == pytest.approx(run["read_bytes_per_step"] / run["tpot_s"])
    assert "| gutenberg-27m | int2 | 100 | 1 | prefill |" in r.stdout


def test_bench_generate_goals_pair_the_modes():
    """goals(): "best" takes each cache's faster mode and names it; "eager" and "graph" pair the
    same modes. Ratios recomputed here from the runs' batches and TPOTs."""
    from kvcc.bench_generate import goals

    def run(cache, context, batch, tpot, largest=False):
        return dict(model="llama-8b-shape", cache=cache, context=context, batch=batch, tpot_s=tpot,
                    tokens_per_s=batch / tpot, largest=largest)

    L = 102400
    runs = [run("bf16", L, 9, 0.040, True), run("bf16-graph", L, 9, 0.042, True), run("int2", L, 65, 0.050, True),
            run("int2-graph", L, 64, 0.044, True), run("bf16", 32768, 1, 0.024), run("bf16-graph", 32768, 1, 0.008),
            run("int2", 32768, 1, 0.026), run("int2-graph", 32768, 1, 0.007)]
    out = goals(runs, L)
    by = {(g["pairing"], g["goal"].split(",")[0].split(" (")[0]): g for g in out}
    conc = by[("best", "concurrent sequences at 102400")]
    assert "(int2 / bf16)" in conc["goal"] and conc["measured"].startswith("65 / 9") and conc["met"]
    assert not any(g["goal"].startswith("concurrent") for g in out if g["pairing"] != "best")
    tps = by[("best", "decode tokens/s at each cache's largest batch")]
    # int2-graph's 64 / 0.044 s beats int2's 65 / 0.050 s; bf16 (eager) beats bf16-graph.
    assert "(int2-graph / bf16)" in tps["goal"] and f"{(64 / 0.044) / (9 / 0.040):.2f}x" in tps["measured"]
    eager = by[("eager", "decode tokens/s at each cache's largest batch")]
    eager_ratio = (65 / 0.050) / (9 / 0.040)
    assert f"{eager_ratio:.2f}x" in eager["measured"] and eager["met"] == (eager_ratio >= 6)
    graph = by[("graph", "decode tokens/s at each cache's largest batch")]
    assert f"{(64 / 0.044) / (9 / 0.042):.2f}x" in graph["measured"]
    b1 = by[("best", "TPOT at batch 1 / 32K")]
    assert "(int2-graph / bf16-graph)" in b1["goal"] and b1["met"]
    assert not by[("eager", "TPOT at batch 1 / 32K")]["met"]  # 26 ms against 24 ms


def test_bench_generate_refuses_graphs_on_the_cpu():
    import kvcc

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvcc.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "kvcc.bench_generate", "--device", "cpu", "--caches", "int2-graph",
                        "--no-capacity"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "needs --device cuda" in r.stderr


@needs_model
def test_zoo_artifact_by_fingerprint():
    r = _run("--model", str(MODEL), "--artifact", "zoo", "--prompt", PROMPT, "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert f"kvcc INT2 ({os.path.basename(_artifact('gutenberg-27m'))})" in r.stderr
    r = _run("--model", str(MODEL), "--artifact", "zoo:no-such-method", "--prompt", "x", "--max-new-tokens", "2")
    assert r.returncode == 1 and "has no no-such-method artifact" in r.stderr
