"""Time the split merge kernels alone (GPU): the [splits, MH, DC] column merge against the unrolled one, over
tiles, at 64 heads and the split counts the policy picks. One-off probe (NOTES.md v13)."""
import itertools
import sys

import torch
import triton
from triton.testing import do_bench

from glm5lab.kernels import sparse_mla as sm

H = 64
rows = []
for T, S in [(1, 32), (8, 16), (8, 4), (32, 4), (32, 2), (128, 2), (128, 4)]:
    po = torch.randn(T, S, H, 512, device="cuda")
    pl = torch.randn(T, S, H, device="cuda") * 3
    ref_o = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16)
    ref_l = torch.empty(T, H, device="cuda")
    mh, dc, sc = sm.merge_tiles(H, S)
    sp = triton.next_power_of_2(S)

    def old():
        sm._merge_columns_kernel[(triton.cdiv(H, mh), T, 512 // dc)](po, pl, ref_o, ref_l, S, H, ref_o.stride(0),
                                                                    ref_o.stride(1), ref_l.stride(0), MH=mh, DC=dc,
                                                                    SC=sc, S_PAD=sp, num_warps=4)
    old()
    t_old = do_bench(old, warmup=20, rep=100) * 1e3
    mb = (po.numel() * 4 + ref_o.numel() * 2) / 1e6
    print(f"T{T:4d} S{S:3d} {mb:6.1f} MB  columns mh{mh} dc{dc} sc{sc}: {t_old:7.2f} us ({mb / t_old:.2f} TB/s)", flush=True)
    best = None
    for MH_, DC_, SC_, nw in itertools.product((4, 8, 16), (64, 128, 256, 512), (1, 2, 4, 8, 16), (4, 8)):
        if SC_ > sp or MH_ * DC_ * SC_ > 16384 or MH_ * DC_ < 32 * nw:
            continue
        out = torch.empty_like(ref_o)
        lse = torch.empty_like(ref_l)

        def new():
            sm._merge_unrolled_kernel[(triton.cdiv(H, MH_), T, 512 // DC_)](po, pl, out, lse, S, H, out.stride(0),
                                                                          out.stride(1), lse.stride(0), MH=MH_,
                                                                          DC=DC_, SC=SC_, S_PAD=sp, num_warps=nw)
        new()
        ok = torch.equal(out.float().isnan(), ref_o.float().isnan()) and (out.float() - ref_o.float()).abs().max() < 1e-2
        us = do_bench(new, warmup=20, rep=100) * 1e3
        if best is None or us < best[0]:
            best = (us, MH_, DC_, SC_, nw, ok)
        rows.append((T, S, MH_, DC_, SC_, nw, us, ok))
    us, MH_, DC_, SC_, nw, ok = best
    print(f"            unrolled best mh{MH_} dc{DC_} sc{SC_} w{nw}: {us:7.2f} us ({mb / us:.2f} TB/s) match {ok}",
          flush=True)
for r in rows:
    print("row", *r)
sys.exit(0)
