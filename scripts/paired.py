"""Paired comparison of two schemes of `kvcc validate --json` outputs on the same documents: the
per-document differences of KL and of NLL, token-weighted, with the clustered standard error of
docs/validation.md ("Error bars"). KL as a percentage of the second scheme's mean; perplexity as
e^Δ − 1 (delta-method se).
usage: paired.py A.json:SCHEME B.json:SCHEME   (the two files may be one; their documents must match)
example: paired.py runtime-pseudo-decode.json:mixed codec-pseudo-decode.json:mixed"""
import json
import math
import sys


def scheme(spec):
    path, name = spec.rsplit(":", 1)
    with open(path) as f:
        j = json.load(f)
    for s in j["schemes"]:
        if s["name"] == name:
            return j["doc_lengths"], s["per_document"]
    sys.exit(f"paired.py: no scheme '{name}' in {path}")


def clustered(diff, w):
    W = sum(w)
    mu = sum(wi * di for wi, di in zip(w, diff)) / W
    D = len(w)
    se = math.sqrt(D / (D - 1) * sum((wi * (di - mu)) ** 2 for wi, di in zip(w, diff))) / W if D > 1 else math.nan
    return mu, se


def main(a_spec, b_spec):
    (la, a), (lb, b) = scheme(a_spec), scheme(b_spec)
    if la != lb:
        sys.exit("paired.py: the two runs evaluated different documents")
    w = [n - 1 for n in la]
    kl_diff = [x["kl"] - y["kl"] for x, y in zip(a, b)]
    mu, se = clustered(kl_diff, w)
    base = sum(wi * y["kl"] for wi, y in zip(w, b)) / sum(w)
    lower = sum(1 for d in kl_diff if d < 0)
    nll_mu, nll_se = clustered([x["nll"] - y["nll"] for x, y in zip(a, b)], w)
    print(f"{a_spec} - {b_spec}: KL {100 * mu / base:+.1f} ± {100 * se / base:.1f} % "
          f"({abs(mu / se):.1f} se, lower on {lower}/{len(w)} documents); "
          f"perplexity {100 * (math.exp(nll_mu) - 1):+.2f} ± {100 * math.exp(nll_mu) * nll_se:.2f} %")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
