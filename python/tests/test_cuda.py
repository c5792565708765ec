"""The runtime and ops on CUDA tensors (a device pool: the CUDA kernels, Hopper GPUs only). The
identity tests against SDPA run on CUDA too (test_runtime.py, device=cuda); here: the device pool
against the host pool on the same inputs, tensors on the wrong device, the ops under
torch.compile and inside a captured CUDA graph. Skipped without a Hopper GPU."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import kvcc  # noqa: E402
from engine_tables import EngineTables  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs a Hopper GPU (sm_90) for the CUDA kernels")

REPO = Path(__file__).resolve().parents[2]
GUT = sorted(glob.glob(str(REPO / "zoo" / "published" / "gutenberg-27m" / "oscar-*" / "artifact.*.kvcc.h5")))[0]


def _pair(pages: int = 16):
    host = kvcc.Runtime(GUT, max_pages=pages, max_sequences=2, device="cpu")
    dev = kvcc.Runtime(GUT, max_pages=pages, max_sequences=2, device="cuda")
    return host, dev


def test_device_pool_follows_host_pool_with_history():
    """Device and host pools given the same tokens (into INT2 history) decode alike. The device's
    own rotation GEMM may round a stored element to the other BF16 / INT2 neighbour, so the bound
    is relative: the existing GPU tests' 1e-2 of the output norm per head (runtime/decode.cu's
    BF16 P and split-q MMAs, tests/gpu_test_cache.cu)."""
    host, dev = _pair(pages=32)
    gen = torch.Generator().manual_seed(11)
    sh, sd = host.add_sequence(), dev.add_sequence()
    worst = 0.0
    for count in (300, 1, 150, 7):
        host.begin_append([sh], [count])
        dev.begin_append([sd], [count])
        for L in range(host.n_layers):
            k = torch.randn(count, host.n_kv_heads, host.head_dim, generator=gen)
            v = torch.randn(count, host.n_kv_heads, host.head_dim, generator=gen)
            host.append(L, k, v)
            dev.append(L, k.cuda(), v.cuda())
            q = torch.randn(1, host.n_heads, host.head_dim, generator=gen)
            a = host.decode(L, [sh], q)
            b = dev.decode(L, [sd], q.cuda()).cpu()
            rel = float((a - b).norm(dim=-1).max() / a.norm(dim=-1).min())
            worst = max(worst, rel)
            assert rel < 1e-2, f"layer {L} after +{count}: relative {rel:.3g}"
    assert host.length(sh) == dev.length(sd) == 458
    print(f"device vs host, history of {458 - 320} tokens: worst relative {worst:.2e}")


def test_wrong_device_tensors_are_refused():
    rt = kvcc.Runtime(GUT, max_pages=2, max_sequences=1, device="cuda")
    s = rt.add_sequence()
    rt.begin_append([s], [3])
    k = torch.zeros(3, rt.n_kv_heads, rt.head_dim)
    with pytest.raises(kvcc.KvccError, match="is on cpu"):
        rt.append(0, k, k)
    cpu_rt = kvcc.Runtime(GUT, max_pages=2, max_sequences=1, device="cpu")
    c = cpu_rt.add_sequence()
    cpu_rt.begin_append([c], [3])
    with pytest.raises(kvcc.KvccError, match="is on cuda"):
        cpu_rt.append(0, k.cuda(), k.cuda())


def test_cuda_ops_under_torch_compile_equal_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    rts = [kvcc.Runtime(GUT, max_pages=4, max_sequences=1, device="cuda") for _ in range(2)]
    seqs = [rt.add_sequence() for rt in rts]
    H, Hq, d = rts[0].n_kv_heads, rts[0].n_heads, rts[0].head_dim
    n = 40

    def step(rt, seq, ks, vs, qs):
        outs = []
        for L in range(rt.n_layers):
            rt.append(L, ks[L], vs[L])
            outs.append(rt.decode(L, [seq], qs[L]))
        return torch.stack(outs)

    ks = [torch.randn(n, H, d, generator=gen).cuda() for _ in range(rts[0].n_layers)]
    vs = [torch.randn(n, H, d, generator=gen).cuda() for _ in range(rts[0].n_layers)]
    qs = [torch.randn(1, Hq, d, generator=gen).cuda().bfloat16() for _ in range(rts[0].n_layers)]
    for rt, s in zip(rts, seqs):
        rt.begin_append([s], [n])
    want = step(rts[0], seqs[0], ks, vs, qs)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(rts[1], seqs[1], ks, vs, qs)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    for rt in rts:
        rt.close()


def test_decode_step_in_a_cuda_graph_replays_later_steps():
    """The engine pattern of kvcc_runtime.h: maxima declared, begin_append outside the graph, the
    step's append + decode of every layer captured once and replayed for each later step (new
    inputs copied into the captured buffers). A runtime with the same maxima run eagerly on the
    same inputs plans the same grids, so the outputs must be equal bit for bit."""
    kw = dict(max_pages=16, max_sequences=2, device="cuda", max_batch=2, max_context=1024, max_step_tokens=600)
    eager, graphed = kvcc.Runtime(GUT, **kw), kvcc.Runtime(GUT, **kw)
    H, Hq, d, layers = eager.n_kv_heads, eager.n_heads, eager.head_dim, eager.n_layers
    gen = torch.Generator().manual_seed(13)
    se = [eager.add_sequence(), eager.add_sequence()]
    sg = [graphed.add_sequence(), graphed.add_sequence()]
    # a prompt step (eager on both): into INT2 history for the first sequence
    counts = [400, 150]
    eager.begin_append(se, counts)
    graphed.begin_append(sg, counts)
    for L in range(layers):
        k = torch.randn(sum(counts), H, d, generator=gen).cuda()
        v = torch.randn(sum(counts), H, d, generator=gen).cuda()
        eager.append(L, k, v)
        graphed.append(L, k, v)
    kb = torch.zeros(layers, 2, H, d, device="cuda")
    vb = torch.zeros_like(kb)
    qb = torch.zeros(layers, 2, Hq, d, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    out = None
    for step in range(4):
        kn = torch.randn(layers, 2, H, d, generator=gen)
        vn = torch.randn(layers, 2, H, d, generator=gen)
        qn = torch.randn(layers, 2, Hq, d, generator=gen)
        eager.begin_append(se, [1, 1])
        want = torch.stack([_append_decode(eager, L, se, kn[L].cuda(), vn[L].cuda(), qn[L].cuda())
                            for L in range(layers)])
        with torch.cuda.stream(stream):
            graphed.begin_append(sg, [1, 1])
            kb.copy_(kn)
            vb.copy_(vn)
            qb.copy_(qn)
            if out is None:
                with torch.cuda.graph(graph, stream=stream):
                    out = torch.stack([_append_decode(graphed, L, sg, kb[L], vb[L], qb[L]) for L in range(layers)])
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {step}: max |graph - eager| {float((out - want).abs().max()):.3g}"
    assert [graphed.length(s) for s in sg] == [eager.length(s) for s in se] == [404, 154]
    eager.close()
    graphed.close()


def _append_decode(rt, layer, seqs, k, v, q):
    rt.append(layer, k, v)
    return rt.decode(layer, seqs, q)


def test_engine_step_in_a_cuda_graph_replays_later_steps():
    """An engine's own device tables: begin_step and every layer's append + decode_step captured in
    one graph; for each later step the engine writes the new lengths and block-table rows into the
    same tensors and replays. A device Runtime keeping its own tables with the same maxima, run
    eagerly on the same tokens, plans the same moves and grids (tests/gpu_test_engine.cu), so the
    outputs must be equal bit for bit. A step outside the limits plans nothing: zeros out,
    step_problem() names it."""
    kw = dict(max_pages=32, max_sequences=4, device="cuda", max_batch=2, max_context=1024, max_step_tokens=600,
              dtype=torch.bfloat16)
    own, eng = kvcc.Runtime(GUT, **kw), kvcc.Runtime(GUT, **kw, engine_tables=True)
    H, Hq, d, layers = own.n_kv_heads, own.n_heads, own.head_dim, own.n_layers
    gen = torch.Generator().manual_seed(14)
    so = [own.add_sequence(), own.add_sequence()]
    tables = EngineTables(eng, [3, 1], seed=15)
    counts = [400, 150]  # a prompt step, eager on both: into INT2 history for the first sequence
    own.begin_append(so, counts)
    eng.begin_step(*tables.step([0, 1], counts), rows=sum(counts))
    for L in range(layers):
        k = torch.randn(sum(counts), H, d, generator=gen).cuda()
        v = torch.randn(sum(counts), H, d, generator=gen).cuda()
        own.append(L, k, v)
        eng.append(L, k, v)
    tables.commit([0, 1], counts)
    assert eng.step_problem() == ""
    # The step's tensors at fixed addresses, as an engine keeps them for its graphs.
    slots, lengths, cnt, table = (t.clone() for t in tables.step([0, 1], [1, 1]))
    kb = torch.zeros(layers, 2, H, d, device="cuda", dtype=torch.bfloat16)
    vb, qb = torch.zeros_like(kb), torch.zeros(layers, 2, Hq, d, device="cuda", dtype=torch.bfloat16)
    stream, graph, out = torch.cuda.Stream(), torch.cuda.CUDAGraph(), None
    for step in range(5):
        kn, vn = (torch.randn(layers, 2, H, d, generator=gen).bfloat16() for _ in range(2))
        qn = torch.randn(layers, 2, Hq, d, generator=gen).bfloat16()
        own.begin_append(so, [1, 1])
        want = torch.stack([_append_decode(own, L, so, kn[L].cuda(), vn[L].cuda(), qn[L].cuda())
                            for L in range(layers)])
        _, new_lengths, _, new_table = tables.step([0, 1], [1, 1])
        with torch.cuda.stream(stream):
            lengths.copy_(new_lengths)
            table.copy_(new_table)
            kb.copy_(kn)
            vb.copy_(vn)
            qb.copy_(qn)
            if out is None:
                with torch.cuda.graph(graph, stream=stream):
                    eng.begin_step(slots, lengths, cnt, table, rows=2)
                    out = torch.stack([_append_decode_step(eng, L, kb[L], vb[L], qb[L]) for L in range(layers)])
            graph.replay()
        torch.cuda.synchronize()
        assert eng.step_problem() == "", f"step {step}"
        assert torch.equal(out, want), f"step {step}: max |graph - eager| {float((out - want).float().abs().max()):.3g}"
        tables.commit([0, 1], [1, 1])
    assert [own.length(s) for s in so] == tables.lengths == [405, 155]
    # A length beyond max_context: nothing planned, zeros, the sequence named.
    with torch.cuda.stream(stream):
        lengths.copy_(torch.tensor([1024, 155], dtype=torch.int32))
        out.fill_(1.0)
        graph.replay()
    torch.cuda.synchronize()
    assert "sequence 0 of the step" in eng.step_problem()
    assert not bool(out.any())
    own.close()
    eng.close()


def _append_decode_step(rt, layer, k, v, q):
    rt.append(layer, k, v)
    return rt.decode_step(layer, q)


def _random_llama(seed: int = 0):
    """A random-weight BF16 Llama with the gutenberg artifact's attention shape (8 layers, 4 query
    and 2 KV heads of 128 channels), small elsewhere, with kvcc attention."""
    import kvcc.hf  # noqa: F401 (registers the "kvcc" attention)
    from transformers import LlamaConfig, LlamaForCausalLM

    info = kvcc.load_artifact(GUT)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=info.n_layers,
                      num_attention_heads=info.n_heads, num_key_value_heads=info.n_kv_heads, head_dim=info.head_dim,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    model.config._attn_implementation = "kvcc"
    return model


def test_decode_graph_steps_equal_eager_steps():
    """kvcc.hf.DecodeGraph (the whole forward of a decode step in one CUDA graph, replayed after
    each begin_append) computes what eager forwards compute: the same kernels on the same inputs,
    so the logits are bit for bit equal, step after step (the tokens are teacher-forced alike), and
    the cache lengths agree; an eager step after graph steps still matches (the graph left the
    cache as eager steps would). Rows run past the sink and recent windows into INT2 pages."""
    import kvcc.hf as hf

    model = _random_llama()
    info = kvcc.load_artifact(GUT)
    batch, prompt, steps = 3, info.sink + info.recent + 40, 12
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (batch, prompt), generator=gen).cuda()
    forced = torch.randint(0, 512, (steps + 1, batch, 1), generator=gen).cuda()
    caches = [hf.KvccCache.for_model(model, GUT, max_tokens=prompt + steps + 1) for _ in range(2)]
    with torch.no_grad():
        first = [model(ids, use_cache=True, **hf.cache_kwargs(model, c)).logits[:, -1] for c in caches]
        assert torch.equal(first[0], first[1])
        graph = hf.DecodeGraph(model, caches[1])
        for s in range(steps):
            pos = torch.full((batch, 1), prompt + s, device="cuda")
            a = model(forced[s], position_ids=pos, use_cache=True, logits_to_keep=1,
                      **hf.cache_kwargs(model, caches[0])).logits[:, -1]
            b = graph(forced[s])
            assert b.shape == a.shape and bool(torch.isfinite(b).all())
            assert torch.equal(a, b), f"step {s}: max |eager - graph| {float((a.float() - b.float()).abs().max()):.3g}"
            assert caches[0].get_seq_length() == caches[1].get_seq_length() == prompt + s + 1
        assert graph.graph is not None and graph.steps == steps
        pos = torch.full((batch, 1), prompt + steps, device="cuda")
        a, b = (model(forced[steps], position_ids=pos, use_cache=True, logits_to_keep=1,
                      **hf.cache_kwargs(model, c)).logits[:, -1] for c in caches)
        assert torch.equal(a, b)
        for c in caches:
            assert [c.runtime.length(r) for r in c.rows] == [prompt + steps + 1] * batch
        # The cache is full: the next step is refused before anything is captured or replayed.
        with pytest.raises(kvcc.CacheFull, match="max_tokens"):
            graph(forced[0])
    for c in caches:
        c.runtime.close()


def test_decode_graph_refuses_what_it_cannot_replay():
    import kvcc.hf as hf

    model = _random_llama()
    cache = hf.KvccCache.for_model(model, GUT, max_tokens=64)
    with pytest.raises(kvcc.KvccError, match="prefill the prompt first"):
        hf.DecodeGraph(model, cache)(torch.zeros(1, 1, dtype=torch.long, device="cuda"))
    with torch.no_grad():
        model(torch.zeros(2, 5, dtype=torch.long, device="cuda"), use_cache=True, **hf.cache_kwargs(model, cache))
    graph = hf.DecodeGraph(model, cache)
    with pytest.raises(kvcc.KvccError, match=r"\[batch, 1\]"):
        graph(torch.zeros(2, 3, dtype=torch.long, device="cuda"))
    graph(torch.zeros(2, 1, dtype=torch.long, device="cuda"))
    with pytest.raises(kvcc.KvccError, match="batch of a graph is fixed"):
        graph(torch.zeros(3, 1, dtype=torch.long, device="cuda"))
    assert cache.get_seq_length() == 6
    cache.runtime.close()


def test_bench_bf16_graph_cache_attends_as_sdpa():
    """The BF16 competitor of bench_generate's graph runs ("bf16-graph": a preallocated token-major
    cache, FlashAttention varlen with seqused_k, steps from a DecodeGraph) computes what SDPA over
    transformers' DynamicCache computes. Both are BF16 attention with float32 accumulation, so they
    differ by BF16 rounding of each layer's output (2^-9 relative) carried through 8 layers: the
    bound, 3e-2 of the logits' norm, is twice 8 x 2^-9. A wrong length, position or causal
    alignment is an O(1) error."""
    from transformers import DynamicCache

    import kvcc.hf as hf
    from kvcc import bench_generate as bg

    model = _random_llama(seed=3)
    cfg = model.config
    batch, prompt, steps = 2, 70, 6
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 512, (batch, prompt), generator=gen).cuda()
    forced = torch.randint(0, 512, (steps, batch, 1), generator=gen).cuda()
    _, StaticCache = bg._static_bf16_classes()
    with torch.no_grad():
        cfg._attn_implementation = "sdpa"
        ref = DynamicCache(config=cfg)
        ref_logits = [model(ids, use_cache=True, **hf.cache_kwargs(model, ref)).logits[:, -1]]
        for s in range(steps):
            pos = torch.full((batch, 1), prompt + s, device="cuda")
            ref_logits.append(model(forced[s], position_ids=pos, use_cache=True,
                                    **hf.cache_kwargs(model, ref)).logits[:, -1])
        cfg._attn_implementation = bg.STATIC_ATTENTION
        cache = StaticCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, prompt + steps, cfg.head_dim,
                            torch.bfloat16, "cuda")
        got = [model(ids, use_cache=True, **hf.cache_kwargs(model, cache)).logits[:, -1]]
        graph = hf.DecodeGraph(model, cache)
        got += [graph(forced[s]) for s in range(steps)]
    assert graph.graph is not None and cache.get_seq_length() == prompt + steps
    for s, (a, b) in enumerate(zip(ref_logits, got)):
        rel = float((a.float() - b.float()).norm() / a.float().norm())
        assert rel < 3e-2, f"step {s}: relative {rel:.3g}"
