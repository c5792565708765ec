"""Joins bench_decode.jsonl (kvcc INT2 + in-house BF16 + copy ceiling + append) and sdpa.jsonl
(PyTorch SDPA) from one gpu_run.sh invocation into gpu_results.json and a short gpu_results.md.
For a gpu_perf.sh run, name its files: --bench perf_NAME_r1.jsonl --tests gpu_tests_NAME.xml,
and --before perf_before_r1.jsonl adds the previous kernel's times from the same run.
usage: gpu_report.py OUT_DIR [--bench FILE] [--tests FILE] [--before FILE]"""
import argparse
import json
import os
import xml.etree.ElementTree as ET


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(out_dir, bench_name="bench_decode.jsonl", tests_name="gpu_tests.xml", before_name=None):
    bench = load(os.path.join(out_dir, bench_name))
    before = {(r["q_heads"], r["kv_heads"], r["batch"], r["context"]): r["int2_us"]
              for r in (load(os.path.join(out_dir, before_name)) if before_name else []) if r["kind"] == "decode"}
    sdpa = load(os.path.join(out_dir, "sdpa.jsonl"))
    device = next((r for r in bench if r["kind"] == "device"), {})
    append = next((r for r in bench if r["kind"] == "append"), None)
    ceiling = device.get("copy_gbps")
    best = {}
    for r in sdpa:
        if "us" not in r or not r.get("outputs_finite"):
            continue
        key = (r["q_heads"], r["kv_heads"], r["batch"], r["context"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    rows = []
    for r in bench:
        if r["kind"] != "decode":
            continue
        key = (r["q_heads"], r["kv_heads"], r["batch"], r["context"])
        s = best.get(key)
        row = dict(r)
        row["sdpa_best_us"] = s["us"] if s else None
        row["sdpa_best_backend"] = f'{s["backend"]}/{s["form"]}' if s else None
        row["speedup_vs_sdpa"] = s["us"] / r["int2_us"] if s else None
        row["speedup_vs_bf16_inhouse"] = r["bf16_inhouse_us"] / r["int2_us"] if r["bf16_inhouse_us"] > 0 else None
        row["int2_fraction_of_copy"] = r["int2_gbps"] / ceiling if ceiling else None
        if key in before:
            row["int2_us_before_same_run"] = before[key]
            row["speedup_vs_sdpa_before"] = s["us"] / before[key] if s else None
        rows.append(row)
    tests = {}
    xml_path = os.path.join(out_dir, tests_name)
    if os.path.exists(xml_path):
        root = ET.parse(xml_path).getroot()
        tests = {"tests": int(root.get("tests", 0)), "failures": int(root.get("failures", 0)),
                 "errors": int(root.get("errors", 0))}
    result = {"device": device, "gpu_tests": tests, "decode": rows, "append": append, "sdpa_raw": sdpa}
    with open(os.path.join(out_dir, "gpu_results.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f'# kvcc decode on {device.get("name", "?")} ({device.get("sms", "?")} SMs)', "",
             f'Copy ceiling (device-to-device, read + write): {ceiling} GB/s. '
             f'GPU tests: {tests}.', "",
             "| q/kv heads | batch | context |" + (" INT2 us before |" if before else "") +
             " INT2 us | BF16 in-house us | best SDPA us (backend) |" + (" x vs SDPA before |" if before else "") +
             " x vs SDPA | x vs in-house | INT2 GB/s | of copy | bytes/token/layer INT2 vs BF16 |",
             "|---|---|---|" + ("---|" if before else "") + "---|---|---|" + ("---|" if before else "") +
             "---|---|---|---|---|"]
    for r in rows:
        f = lambda x, fmt: (fmt % x) if x is not None else "-"
        lines.append(
            f'| {r["q_heads"]}/{r["kv_heads"]} | {r["batch"]} | {r["context"]} | ' +
            (f'{f(r.get("int2_us_before_same_run"), "%.1f")} | ' if before else "") +
            f'{r["int2_us"]:.1f} | '
            f'{r["bf16_inhouse_us"]:.1f} | {f(r["sdpa_best_us"], "%.1f")} ({r["sdpa_best_backend"]}) | ' +
            (f'{f(r.get("speedup_vs_sdpa_before"), "%.2f")} | ' if before else "") +
            f'{f(r["speedup_vs_sdpa"], "%.2f")} | {f(r["speedup_vs_bf16_inhouse"], "%.2f")} | '
            f'{r["int2_gbps"]:.0f} | {f(r["int2_fraction_of_copy"], "%.2f")} | '
            f'{r["int2_bytes_per_token_layer"]:.0f} vs {r["bf16_bytes_per_token_layer"]} |')
    if append:
        lines += ["", f'Append: prefill of {append["prefill_tokens"]} tokens x {append["kv_heads"]} KV heads in '
                      f'{append["prefill_us"]:.0f} us ({append["prefill_gbps"]:.0f} GB/s of fp32 input read + cache '
                      f'written); one decode step of batch {append["decode_step_batch"]}: {append["decode_step_us"]:.1f} us.']
    with open(os.path.join(out_dir, "gpu_results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--bench", default="bench_decode.jsonl")
    ap.add_argument("--tests", default="gpu_tests.xml")
    ap.add_argument("--before", default=None)
    args = ap.parse_args()
    main(args.out_dir, args.bench, args.tests, args.before)
