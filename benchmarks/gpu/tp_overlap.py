"""GPU check of lesson 01: the ring AG+GEMM / GEMM+RS on NCCL beside torch's fused symmetric-memory ops.

``check()`` (run by ``benchmarks/gpu_check.sh``; assumes CUDA) returns rows ``{"check", "ok", "value"}``:

With 2 or more GPUs it launches one rank per GPU (nccl) and, per op at the MLP shapes of a d_model = 4096
layer (tokens = 8192):

- correctness in fp32: ring and tiled ring == all_gather + mm / reduce_scatter(mm) (allclose), and the same for
  ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` when the build has them;
- timing in bf16 (``toolkit.runtime.bench.compare``, a device synchronize after every call): the collective
  alone, the GEMM alone, bulk, ring, the tiled ring (``TILES`` row tiles per chunk), torch's fused op -> overlap = (T_comm + T_gemm - T_fused) / T_comm;
- lesson 01 itself on nccl at the smoke preset: every variant equals one process, kept vs re-gathered input
  bitwise, the memory delta exact.

With one GPU there is no second rank to talk to: it checks the overlap *mechanism* instead, in one process,
with the peer's chunk arriving by a host-to-device copy from pinned memory on a side stream (copy engine)
while the GEMM of the own chunk runs on the compute stream (labelled "1 GPU, emulated link").
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

D_MODEL, TOKENS = 4096, 8192
TILES = 4  # row tiles per chunk of the tiled ring


def _row(check: str, ok: bool, value) -> dict:
    return {"check": f"tp_overlap: {check}", "ok": bool(ok), "value": str(value)}


def rank_main(ctx, cfg: dict) -> dict:
    """Per rank (nccl): correctness (fp32) and timing (bf16) of bulk, ring and torch's fused ops."""
    import torch.distributed as dist

    from toolkit.parallel.tp_overlap import all_gather_matmul, matmul_reduce_scatter
    from toolkit.runtime import compat
    from toolkit.runtime.bench import compare

    group, tp, dev = dist.group.WORLD, ctx.world_size, ctx.device
    M, D = cfg["tokens"], cfg["d_model"]
    F = 4 * D
    fused = hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")
    out = {"fused_available": fused, "correct": {}, "mean_s": {}, "errors": {}}

    def tensors(dtype):
        g = torch.Generator(device=dev).manual_seed(1 + ctx.rank)
        x = torch.randn(M // tp, D, device=dev, dtype=dtype, generator=g)
        w1 = torch.randn(D, F // tp, device=dev, dtype=dtype, generator=g) / D ** 0.5
        h = torch.randn(M, F // tp, device=dev, dtype=dtype, generator=g)
        w2 = torch.randn(F // tp, D, device=dev, dtype=dtype, generator=g) / F ** 0.5
        return x, w1, h, w2

    # -- correctness, fp32 -------------------------------------------------------------------------------
    x, w1, h, w2 = tensors(torch.float32)
    gathered = x.new_empty(M, D)
    compat.all_gather_single(gathered, x, group=group)
    ref_ag = gathered @ w1
    ref_rs = x.new_empty(M // tp, D)
    compat.reduce_scatter_single(ref_rs, h @ w2, group=group)
    ring_ag, ring_x = all_gather_matmul(x, w1, group, mode="ring", keep_gathered=True)
    ring_rs = matmul_reduce_scatter(h, w2, group, mode="ring")
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    out["correct"]["ring AG+GEMM"] = (torch.allclose(ring_ag, ref_ag, rtol=1e-4, atol=1e-4), diff(ring_ag, ref_ag))
    out["correct"]["ring gathered input bitwise"] = (torch.equal(ring_x, gathered), 0.0)
    out["correct"]["ring GEMM+RS"] = (torch.allclose(ring_rs, ref_rs, rtol=1e-4, atol=1e-4), diff(ring_rs, ref_rs))
    tiled_ag, _ = all_gather_matmul(x, w1, group, mode="ring", tiles=TILES)
    tiled_rs = matmul_reduce_scatter(h, w2, group, mode="ring", tiles=TILES)
    for what, got, want in (("AG+GEMM", tiled_ag, ref_ag), ("GEMM+RS", tiled_rs, ref_rs)):
        out["correct"][f"tiled ring {what}"] = (torch.allclose(got, want, rtol=1e-4, atol=1e-4), diff(got, want))
    if fused:
        try:
            name = group.group_name
            _, (sym_ag,) = torch.ops.symm_mem.fused_all_gather_matmul(x, [w1], 0, name)
            sym_rs = torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w2, "sum", 0, name)
            out["correct"]["symm_mem AG+GEMM"] = (torch.allclose(sym_ag, ref_ag, rtol=1e-4, atol=1e-4),
                                                  diff(sym_ag, ref_ag))
            out["correct"]["symm_mem GEMM+RS"] = (torch.allclose(sym_rs, ref_rs, rtol=1e-4, atol=1e-4),
                                                  diff(sym_rs, ref_rs))
        except Exception as err:  # noqa: BLE001 (reported, not fatal: the build may lack symmetric memory)
            out["errors"]["symm_mem"] = f"{type(err).__name__}: {err}"[:300]
            fused = False

    # -- timing, bf16 -----------------------------------------------------------------------------------------
    x, w1, h, w2 = tensors(torch.bfloat16)
    gathered, partial = x.new_empty(M, D), h @ w2
    scattered = partial.new_empty(M // tp, D)
    name = group.group_name
    cands = {
        "AG+GEMM": {"comm": lambda: compat.all_gather_single(gathered, x, group=group),
                    "gemm": lambda: torch.mm(gathered, w1),
                    "bulk": lambda: all_gather_matmul(x, w1, group, mode="bulk"),
                    "ring": lambda: all_gather_matmul(x, w1, group, mode="ring"),
                    "tiled ring": lambda: all_gather_matmul(x, w1, group, mode="ring", tiles=TILES)},
        "GEMM+RS": {"comm": lambda: compat.reduce_scatter_single(scattered, partial, group=group),
                    "gemm": lambda: torch.mm(h, w2),
                    "bulk": lambda: matmul_reduce_scatter(h, w2, group, mode="bulk"),
                    "ring": lambda: matmul_reduce_scatter(h, w2, group, mode="ring"),
                    "tiled ring": lambda: matmul_reduce_scatter(h, w2, group, mode="ring", tiles=TILES)}}
    if fused:
        cands["AG+GEMM"]["torch fused"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(x, [w1], 0, name)
        cands["GEMM+RS"]["torch fused"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w2, "sum", 0, name)
    for op, c in cands.items():
        res = compare(c, warmup=3, steps=10, rounds=5, sync=ctx.barrier)
        out["mean_s"][op] = {k: v.mean_s for k, v in res.items()}
    return out


def _single_gpu() -> list[dict]:
    """One GPU: the ring's overlap mechanism with an emulated link (pinned host -> device on a side stream)."""
    from toolkit.runtime.bench import compare

    dev = torch.device("cuda", 0)
    m, D, N = TOKENS // 2, D_MODEL, 2 * D_MODEL  # tp = 2: own chunk, peer chunk; fc1 columns of one rank
    own = torch.randn(m, D, device=dev, dtype=torch.bfloat16)
    peer_host = torch.randn(m, D, dtype=torch.bfloat16).pin_memory()  # "the peer's chunk", behind a link
    w = torch.randn(D, N, device=dev, dtype=torch.bfloat16) / D ** 0.5
    gathered = torch.empty(2 * m, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty(2 * m, N, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)

    def comm():
        gathered[m:].copy_(peer_host, non_blocking=True)

    def gemm():
        torch.mm(gathered, w, out=out)

    def bulk():
        gathered[:m].copy_(own)
        comm()
        gemm()

    def ring():
        gathered[:m].copy_(own)
        side.wait_stream(torch.cuda.current_stream(dev))  # the buffer is free to be written
        with torch.cuda.stream(side):
            gathered[m:].copy_(peer_host, non_blocking=True)  # the link, on the copy engine
        torch.mm(gathered[:m], w, out=out[:m])  # my chunk meanwhile, on the compute stream
        torch.cuda.current_stream(dev).wait_stream(side)  # the chunk has arrived
        torch.mm(gathered[m:], w, out=out[m:])

    bulk()
    ref = out.clone()
    ring()
    torch.cuda.synchronize(dev)
    equal = torch.equal(out[:m], ref[:m]) and torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
    t = {k: v.mean_s for k, v in compare({"comm": comm, "gemm": gemm, "bulk": bulk, "ring": ring},
                                         warmup=3, steps=10, rounds=5).items()}
    ov = (t["comm"] + t["gemm"] - t["ring"]) / t["comm"]
    return [_row("1 GPU: fewer than 2 GPUs, NCCL ring and torch fused ops not run", True,
                 f"{torch.cuda.device_count()} GPU"),
            _row("1 GPU, emulated link: ring result == bulk", equal, f"{(out - ref).abs().max().item():.3g}"),
            _row("1 GPU, emulated link: overlap (T_comm+T_gemm-T_ring)/T_comm >= 0.5", ov >= 0.5,
                 f"{ov:.2f} (comm {t['comm'] * 1e3:.3f} ms, gemm {t['gemm'] * 1e3:.3f}, bulk {t['bulk'] * 1e3:.3f}, "
                 f"ring {t['ring'] * 1e3:.3f})")]


def check() -> list[dict]:
    n = torch.cuda.device_count()
    if n < 2:
        return _single_gpu()
    from toolkit import launch

    rows = []
    world = min(n, 8)
    res = launch("benchmarks.gpu.tp_overlap:rank_main", world, {"tokens": TOKENS, "d_model": D_MODEL},
                 backend="nccl", timeout_s=900, progress="none")
    r0 = res[0]
    for what in r0["correct"]:
        ok = all(r["correct"][what][0] for r in res)
        rows.append(_row(f"{what} == collective + mm (fp32, tp={world})", ok,
                         f"max diff {max(r['correct'][what][1] for r in res):.3g}"))
    if r0["errors"]:
        rows.append(_row("torch symm_mem fused ops", False, r0["errors"]))
    elif not r0["fused_available"]:
        rows.append(_row("torch symm_mem fused ops", True, "not in this torch build: not compared"))
    for op, t0 in r0["mean_s"].items():
        t = {k: max(r["mean_s"][op][k] for r in res) for k in t0}
        for cand in [c for c in ("ring", "tiled ring", "torch fused") if c in t]:
            ov = (t["comm"] + t["gemm"] - t[cand]) / t["comm"]
            rows.append(_row(f"{op} {cand} overlap (bf16, tp={world}, D={D_MODEL}, M={TOKENS})", ov >= 0.5 or cand != "ring",
                             f"{ov:.2f}  (" + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items()) + ")"))
    heads = 8 * world
    lesson = launch("l01_tp_overlap", world, {"preset": "smoke", "n_head": heads, "d_model": 16 * heads},
                    backend="nccl", timeout_s=900, progress="none")
    worst = max(max(v["dx_max_diff"], v["grad_max_diff"]) for r in lesson for v in r["variants"].values())
    rows.append(_row("lesson 01 on nccl: every variant == one process (max |diff| <= 1e-4)", worst <= 1e-4, f"{worst:.3g}"))
    rows.append(_row("lesson 01 on nccl: kept vs re-gathered input, grads bitwise",
                     all(r["grads_bitwise_keep_vs_regather"] == {"bulk": True, "ring": True} for r in lesson),
                     lesson[0]["grads_bitwise_keep_vs_regather"]))
    v = lesson[0]["variants"]
    delta = v["ring+keep"]["saved_act_bytes"] - v["ring"]["saved_act_bytes"]
    rows.append(_row("lesson 01 on nccl: saved-activation delta == closed form",
                     delta == lesson[0]["kept_bytes_closed_form"], f"{delta} vs {lesson[0]['kept_bytes_closed_form']}"))
    return rows


if __name__ == "__main__":
    for row in check():
        print(f"{'ok ' if row['ok'] else 'FAIL'}  {row['check']}: {row['value']}")
