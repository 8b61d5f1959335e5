"""Variants of our Triton varlen kernel's key loop at Qwen3-VL's 16 x 72 heads (GPU).

    OUT=benchmarks/results python benchmarks/triton_variants_probe.py

How `models/triton_attention.py` got its loop: a copy of the kernel with switches, each variant
in its own process (a fault costs its row), on one 12544-row segment (1792x1792), 8 x 784 rows,
the padded layout of `tests/models/test_gpu_attention.py`, and odd lengths (1-2048 rows, also with
8x sharper logits), with no rows to spare past the last segment; error against float32, time in a
CUDA graph (best of 3), dense cuDNN alongside. Switches:
- TAIL: where the key mask applies: 0 every block; 1 a masked block peeled off after the loop;
  2 a uniform branch in the loop (what the kernel does); 3 the masked block first;
- TMA: keys and values through device-side tensor descriptors (zero fill past the segment);
- LAZY: rescale the accumulator only when the row maximum grows by more than 8 (log2);
- MODULE: the kernel as shipped at the time of the run.
Every variant takes the row maximum on the raw scores and folds the scale into one FMA.
`triton_variants_probe.json` is the run of this version (H100, Triton 3.6); the results README
also quotes two runs of earlier versions of this script (other switches), not kept.
"""

import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from encoder_graphs.selfcheck import graph_replay_ms

LOG2_E = 1.4426950408889634


@triton.jit
def _step(
    acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db, col_b_ok, cols0, n0, length,
    s_kt, s_vt, scale_log2,
    NA: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, LAZY: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    keep = (n0 + cols0) < length
    if TMA:
        ka = kda.load([n0, 0])
        kb = kdb.load([n0, NA])
    elif True:
        ka = tl.load(k_rows + n0 * s_kt + da[None, :], mask=keep[:, None], other=0.0)
        kb = tl.load(k_rows + n0 * s_kt + db[None, :], mask=keep[:, None] & col_b_ok[None, :], other=0.0)
    else:
        ka = tl.load(k_rows + n0 * s_kt + da[None, :])
        kb = tl.load(k_rows + n0 * s_kt + db[None, :], mask=col_b_ok[None, :], other=0.0)
    s = tl.dot(qa, tl.trans(ka))
    s = tl.dot(qb, tl.trans(kb), s)
    if MASK == 1:
        s = tl.where(keep[None, :], s, float("-inf"))
    if MASK == 2:
        if n0 + BLOCK_N > length:
            s = tl.where(keep[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    if LAZY:
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_new)
            acc_a = acc_a * alpha[:, None]
            acc_b = acc_b * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.math.exp2(s * scale_log2 - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        p = tl.math.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        m_i = m_new
    if TMA:
        va = vda.load([n0, 0])
        vb = vdb.load([n0, NA])
    elif True:
        va = tl.load(v_rows + n0 * s_vt + da[None, :], mask=keep[:, None], other=0.0)
        vb = tl.load(v_rows + n0 * s_vt + db[None, :], mask=keep[:, None] & col_b_ok[None, :], other=0.0)
    else:
        va = tl.load(v_rows + n0 * s_vt + da[None, :])
        vb = tl.load(v_rows + n0 * s_vt + db[None, :], mask=col_b_ok[None, :], other=0.0)
    p = p.to(va.dtype)
    acc_a = tl.dot(p, va, acc_a)
    acc_b = tl.dot(p, vb, acc_b)
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _fwd(
    Q, K, V, Out, CU, scale_log2,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    DIM: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TAIL: tl.constexpr, LAZY: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.program_id(2)
    start = tl.load(CU + seg)
    length = tl.load(CU + seg + 1) - start
    if pid_m * BLOCK_M >= length:
        return
    start = start.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    cols0 = tl.arange(0, BLOCK_N)
    da = tl.arange(0, NA)
    db = NA + tl.arange(0, NB)
    col_b_ok = db < DIM
    q_rows = Q + start * s_qt + tl.multiple_of(head * s_qh, 8) + rows[:, None] * s_qt
    qa = tl.load(q_rows + da[None, :], mask=row_ok[:, None], other=0.0)
    qb = tl.load(q_rows + db[None, :], mask=row_ok[:, None] & col_b_ok[None, :], other=0.0)
    kbase = K + start * s_kt + tl.multiple_of(head * s_kh, 8)
    vbase = V + start * s_vt + tl.multiple_of(head * s_vh, 8)
    if TMA:
        kda = tl.make_tensor_descriptor(kbase, [length, DIM], [s_kt, 1], [BLOCK_N, NA])
        kdb = tl.make_tensor_descriptor(kbase, [length, DIM], [s_kt, 1], [BLOCK_N, NB])
        vda = tl.make_tensor_descriptor(vbase, [length, DIM], [s_vt, 1], [BLOCK_N, NA])
        vdb = tl.make_tensor_descriptor(vbase, [length, DIM], [s_vt, 1], [BLOCK_N, NB])
    else:
        kda = 0
        kdb = 0
        vda = 0
        vdb = 0
    k_rows = kbase + cols0[:, None] * s_kt
    v_rows = vbase + cols0[:, None] * s_vt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, NA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, NB], tl.float32)
    if TAIL == 0:  # every block masked
        for n0 in range(0, length, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _step(acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db,
                col_b_ok, cols0, n0, length, s_kt, s_vt, scale_log2, NA, BLOCK_N, 1, LAZY, TMA)  # fmt: skip
    elif TAIL == 2:  # one loop, the score mask under a uniform branch
        for n0 in range(0, length, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _step(acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db,
                col_b_ok, cols0, n0, length, s_kt, s_vt, scale_log2, NA, BLOCK_N, 2, LAZY, TMA)  # fmt: skip
    elif TAIL == 3:  # the partial block first, then the full ones
        n_full = length // BLOCK_N * BLOCK_N
        if n_full < length:
            acc_a, acc_b, m_i, l_i = _step(acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db,
                col_b_ok, cols0, n_full, length, s_kt, s_vt, scale_log2, NA, BLOCK_N, 1, LAZY, TMA)  # fmt: skip
        for n0 in range(0, n_full, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _step(acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db,
                col_b_ok, cols0, n0, length, s_kt, s_vt, scale_log2, NA, BLOCK_N, 0, LAZY, TMA)  # fmt: skip
    else:  # full blocks unmasked, then the masked tail
        n_full = length // BLOCK_N * BLOCK_N
        for n0 in range(0, n_full, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _step(acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db,
                col_b_ok, cols0, n0, length, s_kt, s_vt, scale_log2, NA, BLOCK_N, 0, LAZY, TMA)  # fmt: skip
        if n_full < length:
            acc_a, acc_b, m_i, l_i = _step(acc_a, acc_b, m_i, l_i, qa, qb, kda, kdb, vda, vdb, k_rows, v_rows, da, db,
                col_b_ok, cols0, n_full, length, s_kt, s_vt, scale_log2, NA, BLOCK_N, 1, LAZY, TMA)  # fmt: skip
    inv = 1.0 / l_i
    o_rows = Out + start * s_ot + tl.multiple_of(head * s_oh, 8) + rows[:, None] * s_ot
    tl.store(o_rows + da[None, :], (acc_a * inv[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])
    o_b = (acc_b * inv[:, None]).to(Out.dtype.element_ty)
    tl.store(o_rows + db[None, :], o_b, mask=row_ok[:, None] & col_b_ok[None, :])


def run(q, k, v, cu, max_seqlen, out, bm, bn, warps, stages, **flags):
    if flags.get("MODULE"):
        from models.triton_attention import TileConfig, varlen_attention

        return varlen_attention(q, k, v, cu, max_seqlen, None, out, TileConfig(bm, bn, warps, stages))
    flags = {k: v for k, v in flags.items() if k != "MODULE"}
    rows, heads, dim = q.shape
    grid = (triton.cdiv(max_seqlen, bm), heads, cu.numel() - 1)
    _fwd[grid](
        q, k, v, out, cu, dim**-0.5 * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DIM=dim, NA=64, NB=16, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags,
    )  # fmt: skip
    return out


from models.layout import padded_cu_seqlens  # noqa: E402

_PADDED = padded_cu_seqlens([3136, 784, 784, 256, 256, 256], 8192, 4096, 64).tolist()
LAYOUTS = {
    "padded": [b - a for a, b in zip(_PADDED[:-1], _PADDED[1:])],
    "8x448": [784] * 8,
    "1792": [12544],
    "odd": [123, 124, 1000, 64, 65, 1, 2048, 200, 7],
    "odd sharp": [123, 1000, 65, 2048, 7],
}


def one(spec):
    """Child process: one (tile, flags) over every layout: timing + error against float32."""
    tile, flags = spec["tile"], spec["flags"]
    heads, dim = 16, 72
    if flags.get("TMA"):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    results = []
    for layout, lengths in LAYOUTS.items():
        torch.manual_seed(0)
        rows = sum(lengths)
        qkv = torch.randn(rows, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.unbind(1)
        q = q.contiguous() * (8.0 if "sharp" in layout else 1.0)
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
        out = torch.zeros_like(q)
        fn = lambda: run(q, k, v, cu, max(lengths), out, *tile, **flags)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        err, start = 0.0, 0
        for n in lengths:
            if n == 0:
                continue
            qs, ks, vs = (t[start : start + n].float().transpose(0, 1) for t in (q, k, v))
            ref = torch.nn.functional.scaled_dot_product_attention(qs[:, :2048], ks, vs).transpose(0, 1)
            o = out[start : start + min(n, 2048)].float()
            err = max(err, ((o - ref).abs().max() / ref.abs().max()).item())
            start += n
            if layout in ("1792", "8x448"):
                break
        row = {"layout": layout, "tile": tile, "flags": flags, "err": err}
        if layout in ("1792", "8x448", "padded"):
            row["ms"] = min(graph_replay_ms(fn, repeats=20) for _ in range(3))
            row["useful_tflops"] = 4 * sum(n * n for n in lengths) * heads * dim / row["ms"] / 1e9
        results.append(row)
    return results


def cudnn_dense(layout):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    lengths = [12544] if layout == "1792" else [784] * 8
    n, c = lengths[0], len(lengths)
    qkv = torch.randn(c * n, 3, 16, 72, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.unflatten(0, (c, n)).transpose(1, 2) for t in qkv.unbind(1))
    q = q.contiguous()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ms = min(
            graph_replay_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), repeats=20)
            for _ in range(3)
        )
    flops = 4 * sum(x * x for x in lengths) * 16 * 72
    row = {"layout": layout, "tile": "cudnn dense", "flags": {}, "ms": ms, "err": None}
    return row | {"useful_tflops": flops / ms / 1e9}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(one(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    import subprocess

    base = dict(TAIL=0, LAZY=False, TMA=False, MODULE=False)
    variants = [
        ((128, 64, 4, 3), dict(MODULE=True)),
        ((128, 64, 4, 3), dict(TAIL=0)),
        ((128, 64, 4, 3), dict(TAIL=1)),
        ((128, 64, 4, 3), dict(TAIL=2)),
        ((128, 64, 4, 3), dict(TAIL=3)),
        ((128, 64, 4, 3), dict(TAIL=2, TMA=True)),
        ((128, 64, 4, 3), dict(TAIL=3, TMA=True)),
    ]
    results = [cudnn_dense("1792"), cudnn_dense("8x448")]
    for tile, flags in variants:
        spec = {"tile": tile, "flags": {**base, **flags}}
        t0 = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, timeout=100
            )
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(line[0][7:]) if line else [{**spec, "layout": "-", "error": proc.stderr[-600:]}]
        except subprocess.TimeoutExpired:
            res = [{**spec, "layout": "-", "error": "timeout"}]
        for r in res:
            r["wall_s"] = round(time.time() - t0, 1)
            print(json.dumps(r), flush=True)
        results += res
    out = os.environ.get("OUT", "benchmarks/results")
    with open(os.path.join(out, "triton_variants_probe.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("| layout | tile | flags | ms | useful TFLOP/s | err |")
    for r in results:
        fl = ",".join(k for k, v in r.get("flags", {}).items() if v)
        if "error" in r:
            print(f"| {r['layout']} | {r['tile']} | {fl} | ERROR {r['error'][-200:]!r} |")
        else:
            ms, tflops = r.get("ms", 0), r.get("useful_tflops", 0)
            print(f"| {r['layout']} | {r['tile']} | {fl} | {ms:.3f} | {tflops:.0f} | {r['err']} |")
