"""Sparse-MLA kernel benchmark: glm5lab's fused Triton kernel vs FlashMLA's sparse kernels vs a torch gather,
ONE process, the SAME inputs (issue 7).

GPU profile: KV cache of 524,288 slots (8192 blocks of 64), top-k 2048 random slots per token, bf16 q,
heads {8, 16, 64, 128} x tokens {1, 8, 32, 128, 512}. For every implementation and shape: median time
(glm5lab.bench.timing.bench: CUDA events, L2 flushed), effective bandwidth and fraction of the memory
roofline (bytes that must move = tokens x topk x row bytes + q + out, over the device-to-device copy
bandwidth measured in this run), TFLOP/s, ratio against the matching FlashMLA kernel, and accuracy against
the float64 reference on the (dequantized) cache. Long-format rows go to a CSV via records.append_rows.
CPU profile: tiny shapes under the interpreter; exercises the code path, never reported as speed.

    PYTHONPATH=. python -m glm5lab.bench.kernel_bench --out results/kernels/kernel_bench_h200.csv

--fp8-v4 (or GLM5LAB_BENCH_FP8_V4=1) also times the private fp8_ds_mla code paths of NOTES.md "v4" beside the
default fp8 path, on the same inputs, at H8 T128, H8 T512 and H64 T512 only (FP8_V4_SHAPES).
--interleave ROUNDS (GPU) times each shape's CUDA graphs once more in interleaved rounds, for A/B differences of a
few percent (two identical kernels timed one after another differed by up to 6%: NOTES.md v16-v17); the ratios to
FlashMLA are then taken round by round (`interleaved_rows`), so a drift of the machine cancels. The suite does this
for glm5lab and FlashMLA.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors

SUITE = "sparse_mla_kernel"
FP8_V4_ENV = "GLM5LAB_BENCH_FP8_V4"
FP8_V4_SHAPES = {(8, 128), (8, 512), (64, 512)}


# the Gluon kernels' tiles timed by --gluon (NOTES.md v7, v8): the mma.sync 16-head kernel with 32-row steps on 4 warps
# and 2 ring stages (two CTAs a SM) or 3 (one), or 64-row steps on 8 warps (one CTA a SM)
# (each tile names every key of the tile, so that it means the same laid over any default)
GLUON_VARIANTS = [("s2", {"rows": False, "ws": False, "block_n": 32, "num_warps": 4, "stages": 2, "resident": 2}),
                  ("s3", {"rows": False, "ws": False, "block_n": 32, "num_warps": 4, "stages": 3, "resident": 1}),
                  ("n64w8", {"rows": False, "ws": False, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1}),
                  ("n64w8s3", {"rows": False, "ws": False, "block_n": 64, "num_warps": 8, "stages": 3,
                               "resident": 1}),
                  # > 16 heads: the 64-head wgmma kernel (NOTES.md v8), 64- or 32-row steps (32: bf16/fp16 only)
                  ("wg64", {"rows": False, "ws": False, "converter": False, "p_smem": False,
                            "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1}),
                  ("wg64n32", {"rows": False, "ws": False, "converter": False, "p_smem": False,
                               "block_h": 64, "block_n": 32, "num_warps": 8, "stages": 2, "resident": 1}),
                  # ... warp-specialized, a loader warpgroup beside the two consumer warpgroups (the default since
                  # NOTES.md v12), its split partials in fp32 (as before v14)
                  ("ws64", {"rows": False, "ws": True, "converter": False, "p_smem": False,
                            "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1,
                            "partials": "fp32"}),
                  # ... writing its split partials in fp16 with a scale a head (half the bytes to write and merge;
                  # the default since NOTES.md v14)
                  ("ws64p16", {"rows": False, "ws": True, "converter": False, "p_smem": False,
                               "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1,
                               "partials": "fp16"}),
                  # ... fp8_ds_mla with the dequantization in a producer warpgroup, in place in a 2-slot ring of
                  # bf16 tiles the consumers read as the bf16 kernel does (NOTES.md v15)
                  ("ws64c", {"rows": False, "ws": True, "converter": True, "p_smem": False, "f16_tile": False,
                             "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1,
                             "partials": "fp16"}),
                  # ... its raw rows unswizzled (the first build, v15 runs 1-2)
                  ("ws64cu", {"rows": False, "ws": True, "converter": True, "p_smem": False, "f16_tile": False,
                              "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1,
                              "partials": "fp16", "_raw_swizzle": False}),
                  # ... both with P.V's A operand through shared memory: no exchange of S between the consumer
                  # warpgroups (NOTES.md v16); 16-bit or fp8_ds_mla's loader form (ws64ps), the converter form (ws64cps)
                  ("ws64ps", {"rows": False, "ws": True, "converter": False, "p_smem": True, "block_h": 64,
                              "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16"}),
                  ("ws64cps", {"rows": False, "ws": True, "converter": True, "p_smem": True, "f16_tile": False,
                               "block_h": 64,
                               "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16"}),
                  # ... fp8_ds_mla's converter form with the dequantized tile and q's latent part in fp16 (NOTES.md
                  # v28), and without its power of two a step (a private A/B switch: values beyond fp16 overflow)
                  ("ws64cps16", {"rows": False, "ws": True, "converter": True, "p_smem": True, "block_h": 64,
                                 "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16",
                                 "f16_tile": True}),
                  ("ws64cps16u", {"rows": False, "ws": True, "converter": True, "p_smem": True, "block_h": 64,
                                  "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16",
                                  "f16_tile": True, "_f16_pow2": False}),
                  # ... P against the kept max, the row max reduced across the warpgroups only when a warp flags
                  # a move (NOTES.md v31; the fp16 tile's default since v32): that form and the 16-bit / loader one
                  ("ws64cps16k", {"rows": False, "ws": True, "converter": True, "p_smem": True, "block_h": 64,
                                  "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16",
                                  "f16_tile": True, "kept_p": True}),
                  ("ws64psk", {"rows": False, "ws": True, "converter": False, "p_smem": True, "block_h": 64,
                               "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16",
                               "kept_p": True}),
                  # <= 16 heads, bf16/fp16: the rows-as-M wgmma kernel (the default at small batches)
                  ("rows64", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 2,
                              "resident": 1}),
                  # <= 16 heads, bf16/fp16: the mma.sync kernel with 64-row steps on 4 warps, one CTA a SM, no split
                  # below one wave (NOTES.md v8 run 9: 0.92 of the roofline at 8 heads x 128 tokens)
                  ("n64", {"rows": False, "ws": False, "block_n": 64, "num_warps": 4, "stages": 2, "resident": 1}),
                  # <= 16 heads, fp8_ds_mla: the warp-specialized rows-as-M kernel (NOTES.md v9), one CTA a SM
                  ("ws8", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 2, "resident": 1}),
                  # ... its dual-consumer form: no converter, two consumer warpgroups converting the e4m3 bytes
                  # into wgmma's register operand, 4 stages of raw rows (NOTES.md v17)
                  ("ws8x2", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                             "dual_consumers": True, "pipe": ""}),
                  # ... with O^T's products issued async, two at a time, consumers at 224 registers (NOTES.md v19)
                  ("ws8x2o", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                              "dual_consumers": True, "pipe": "o"}),
                  # ... its 8-head tile (<= 8 heads), a persistent kernel (NOTES.md v18), and its timing
                  # diagnostics: the consumers alone (d2), the gathers alone (d3)
                  ("ws8x2p", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4, "stages": 4,
                              "resident": 1, "dual_consumers": True, "pipe": ""}),
                  # ... with both products issued async, two at a time (the default in v19-v35, on split calls from v20)
                  ("ws8x2pp", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4, "stages": 4,
                               "resident": 1, "dual_consumers": True, "pipe": "so"}),
                  *((f"ws8x2pd{d}", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4,
                                     "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "so",
                                     "_diagnostic": True, "ws_diag": d}) for d in (2, 3)),
                  # ... with three products in flight on both sides (pipe "s3o3", the default unsplit in
                  # v20-v34, "s3o3p" since v35; consumers at 224 registers), and its timing diagnostics
                  ("ws8x2pp3", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4, "stages": 4,
                                "resident": 1, "dual_consumers": True, "pipe": "s3o3"}),
                  # ... the dual-consumer forms with P^T against the kept max (NOTES.md v31; ws8x2ok the 16-head default
                  # on split calls, ws8x2sok below on unsplit ones in v34, both with pipe "p" since v35)
                  ("ws8x2ok", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                               "dual_consumers": True, "pipe": "o", "kept_p": True}),
                  ("ws8x2ppk", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4, "stages": 4,
                                "resident": 1, "dual_consumers": True, "pipe": "so", "kept_p": True}),
                  ("ws8x2pp3k", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4, "stages": 4,
                                 "resident": 1, "dual_consumers": True, "pipe": "s3o3", "kept_p": True}),
                  *((f"ws8x2p3d{d}", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4,
                                      "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "s3o3",
                                      "_diagnostic": True, "ws_diag": d}) for d in (2, 3)),
                  # ... the 16-head tile with S^T's products pipelined too (pipe "so", NOTES.md v34; with the kept
                  # max v34's default unsplit), without the kept max, its consumers alone (d2) and gathers alone (d3)
                  ("ws8x2sok", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                                "dual_consumers": True, "pipe": "so", "kept_p": True}),
                  ("ws8x2so", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                               "dual_consumers": True, "pipe": "so"}),
                  ("ws8x2sod2", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4,
                                 "resident": 1, "dual_consumers": True, "pipe": "so", "_diagnostic": True,
                                 "ws_diag": 2}),
                  ("ws8x2sod3", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4,
                                 "resident": 1, "dual_consumers": True, "pipe": "so", "_diagnostic": True,
                                 "ws_diag": 3}),
                  # ... P^T's tiles re-derived each step (pipe "p", NOTES.md v35: no spill left in the 16-head "so"
                  # build, 16 bytes of 56 in the 8-head "s3o3" + kept; the defaults in v35: ws8x2sokp and ws8x2okp
                  # at 16 heads, ws8x2pp3p at 8 unsplit; since v36 ws8x2sokp at 16 and ws8x2esopk at 8)
                  ("ws8x2sokp", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                                 "dual_consumers": True, "pipe": "sop", "kept_p": True}),
                  ("ws8x2okp", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4, "resident": 1,
                                "dual_consumers": True, "pipe": "op", "kept_p": True}),
                  ("ws8x2pp3kp", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4,
                                  "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "s3o3p", "kept_p": True}),
                  ("ws8x2pp3p", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4,
                                 "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "s3o3p"}),
                  # ... the dual kernel's 8-head tile one item a program (not persistent, NOTES.md v36; "sop" with
                  # the kept max the default at <= 8 heads from 16 tokens since), without the kept max, "s3o3p"
                  *((f"ws8x2e{pipe}{'k' if kept else ''}", {"rows": True, "ws": False, "block_h": 8, "block_n": 64,
                                                           "num_warps": 4, "stages": 4, "resident": 1,
                                                           "dual_consumers": True, "pipe": pipe, "kept_p": kept,
                                                           "one_item": True})
                    for pipe, kept in (("sop", True), ("sop", False), ("s3o3p", False))),
                  # ... and its timing diagnostics (wrong results on purpose; no kept max under a diagnostic): the
                  # consumers alone (d2), the gathers alone (d3)
                  *((f"ws8x2esopd{d}", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4,
                                        "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "sop",
                                        "one_item": True, "_diagnostic": True, "ws_diag": d}) for d in (2, 3)),
                  # ... its step on ONE consumer warpgroup, 2 stages, two CTAs a SM ("paired", NOTES.md v38): the
                  # 8-head tile "sop" + kept, "s3o3p"; the 16-head tile "sop" + kept, "op" + kept and "sop" (the
                  # other 16-head forms that do not spill at the paired consumer's 216 registers, v39); both tiles'
                  # "sop" consumers alone (d2) and gathers alone (d3)
                  *((f"pair{h}{pipe}{'k' if kept else ''}", {"rows": True, "ws": False, "block_h": h, "block_n": 64,
                                                            "num_warps": 4, "stages": 2, "resident": 2,
                                                            "dual_consumers": True, "paired": True, "pipe": pipe,
                                                            "kept_p": kept, "one_item": True})
                    for h, pipe, kept in ((8, "sop", True), (8, "s3o3p", False), (16, "sop", True), (16, "op", True),
                                          (16, "sop", False), (8, "sopfh", True), (16, "sopfh", True),
                                          (16, "soph", True))),
                  # ... the shorter consumer step (NOTES.md v40: "f" q's rope part staged times its multiplier, "h"
                  # P^T scaled in fp16 pairs) on the dual kernel's 16-head tile ("h" alone: "f" spills there) and its
                  # 8-head tile one item a program
                  ("ws8x2sokph", {"rows": True, "ws": False, "block_h": 16, "block_n": 64, "num_warps": 4,
                                  "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "soph", "kept_p": True}),
                  ("ws8x2esopfhk", {"rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4,
                                    "stages": 4, "resident": 1, "dual_consumers": True, "pipe": "sopfh",
                                    "kept_p": True, "one_item": True}),
                  # ... and the paired defaults with the loader's row offsets in 32 bits ("offs32", NOTES.md v40)
                  *((f"pair{h}{pipe}k32", {"rows": True, "ws": False, "block_h": h, "block_n": 64, "num_warps": 4,
                                           "stages": 2, "resident": 2, "dual_consumers": True, "paired": True,
                                           "pipe": pipe, "kept_p": True, "one_item": True, "offs32": True})
                    for h, pipe in ((8, "sop"), (16, "sopfh"))),
                  *((f"pair{h}sopd{d}", {"rows": True, "ws": False, "block_h": h, "block_n": 64, "num_warps": 4,
                                          "stages": 2, "resident": 2, "dual_consumers": True, "paired": True,
                                          "pipe": "sop", "one_item": True, "_diagnostic": True, "ws_diag": d})
                    for h in (8, 16) for d in (2, 3)),
                  # ... the 16-head tile's timing diagnostics as v34's default ran split calls (pipe "o"; wrong results
                  # on purpose): the consumers alone (d2), the gathers alone (d3)
                  *((f"ws8x2d{d}", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 4,
                                    "resident": 1, "dual_consumers": True, "pipe": "o", "_diagnostic": True,
                                    "ws_diag": d})
                    for d in (2, 3)),
                  # ... timing diagnostics, wrong results on purpose (sparse_mla_sm90.WS_DIAGNOSTICS, NOTES.md v10-11):
                  # loader and converter alone (d1), the consumer alone (d2), the gathers alone (d3), converter and
                  # consumer without gathers (d4)
                  *((f"ws8d{d}", {"rows": True, "ws": False, "block_n": 64, "num_warps": 4, "stages": 2,
                                  "resident": 1, "_diagnostic": True, "ws_diag": d}) for d in (1, 2, 3, 4)),
                  # ... and of the warp-specialized 64-head kernel (NOTES.md v13): the consumers alone (d2), the
                  # gathers alone (d3), fp8_ds_mla without its dequantization (d5)
                  *((f"ws64d{d}", {"rows": False, "ws": True, "converter": False, "p_smem": False,
                                   "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1,
                                   "_diagnostic": True, "ws_diag": d})
                    for d in (2, 3, 5)),
                  # ... and of its converter form (v15): the producer alone (d1), the consumers alone (d2), the
                  # gathers alone (d3), producer and consumers without gathers (d4), and d4 converting bytes held in
                  # registers instead of reading the raw rows from shared memory (d6, v16)
                  *((f"ws64cd{d}", {"rows": False, "ws": True, "converter": True, "p_smem": False, "f16_tile": False,
                                    "block_h": 64, "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1,
                                    "partials": "fp16", "_diagnostic": True, "ws_diag": d}) for d in (1, 2, 3, 4, 6)),
                  # ... and of the P-through-shared-memory consumers (v16): the consumers alone (d2; 16-bit ws64psd2,
                  # the converter form ws64cpsd2), the converter form's producer and consumers without gathers (d4)
                  ("ws64psd2", {"rows": False, "ws": True, "converter": False, "p_smem": True, "block_h": 64,
                                "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16",
                                "_diagnostic": True, "ws_diag": 2}),
                  *((f"ws64cpsd{d}", {"rows": False, "ws": True, "converter": True, "p_smem": True, "f16_tile": False,
                                      "block_h": 64,
                                      "block_n": 64, "num_warps": 8, "stages": 2, "resident": 1, "partials": "fp16",
                                      "_diagnostic": True, "ws_diag": d}) for d in (2, 4))]
# every tile names dual_consumers, block_h, pipe, kept_p, one_item and paired: the <= 16-head fp8_ds_mla default is
# the dual-consumer form (NOTES.md v17; up to one wave, its paired form beyond since v38), with 8-head tiles at <= 8
# heads (v18; one item a program since v36) whose products are pipelined (v19), with P^T against the kept max (v31),
# its paired form's loader with 32-bit row offsets where the cache allows (v41), and a tile laid over it must not
# inherit any
GLUON_VARIANTS = [(n, {"dual_consumers": False, "block_h": 16, "pipe": "", "kept_p": False, "one_item": False,
                       "paired": False, "offs32": False, **cfg})
                  for n, cfg in GLUON_VARIANTS]
# tiles that exist for one kind of cache only: True = fp8_ds_mla, False = bf16/fp16
VARIANT_FP8_ONLY = {"rows64": False, "n64": False, "ws64d5": True, "ws64psd2": False,
                    **{n: True for n, _ in GLUON_VARIANTS if n.startswith(("ws8", "ws64c", "pair"))}}
GLUON_ENV = "GLM5LAB_BENCH_GLUON"   # names of GLUON_VARIANTS to time (comma-separated; default: all)


def gluon_variants(names: str = "", source: str = GLUON_ENV) -> list:
    """The GLUON_VARIANTS named in `names` (comma-separated, as in env GLM5LAB_BENCH_GLUON; `source` names where they
    came from in the error); when empty, all but the timing diagnostics (wrong results on purpose), which run only by
    name."""

    known = dict(GLUON_VARIANTS)
    pick = [x.strip() for x in names.split(",") if x.strip()]
    unknown = [x for x in pick if x not in known]
    if unknown:
        raise Glm5labError(f"unknown Gluon variant(s) {unknown} in {source}; expected names from {list(known)}")
    if pick:
        return [(n, known[n]) for n in pick]
    return [(n, cfg) for n, cfg in GLUON_VARIANTS if not cfg.get("_diagnostic")]


def fp8_v4_variants(H: int, T: int) -> list:
    """(implementation name, _config) of the NOTES.md v4 fp8 paths timed at (H, T). The "diag" ones are timing
    diagnostics with WRONG results by design (their error columns show it); only at H8 T512."""
    if (H, T) not in FP8_V4_SHAPES:
        return []
    out = [("glm5lab-fp8-v4-reload", {"fp8_path": "reload", **({"block_n": 64} if H <= 16 else {})})]
    if H <= 16:   # reload_words needs 161 KB of shared memory at 16x64 tiles: one CTA a SM, so 8 warps
        out.append(("glm5lab-fp8-v4-words-w8", {"fp8_path": "reload_words", "block_n": 64, "num_warps": 8}))
    if (H, T) == (8, 512):
        out.append(("glm5lab-fp8-v4-reload-w8", {"fp8_path": "reload", "block_n": 64, "num_warps": 8}))
        out.append(("glm5lab-fp8-v4-diag-no-scales", {"fp8_path": "_diag_reload_no_scales", "block_n": 64,
                                                       "_diagnostic": True}))
        out.append(("glm5lab-fp8-v4-diag-no-convert", {"fp8_path": "_diag_reload_no_convert", "block_n": 64,
                                                        "_diagnostic": True}))
    return out


V5_ENV = "GLM5LAB_BENCH_V5"
V5_SHAPES = {(8, 1), (8, 8), (8, 128), (8, 512), (16, 128), (16, 512), (64, 128), (64, 512)}


def v5_variants(H: int, T: int) -> list:
    """(implementation name, layout, sparse_mla_attention keyword arguments) of NOTES.md "v5" timed at (H, T)
    in V5_SHAPES, beside the default: the v4 default for <= 16 heads fp8 ("reload" on 16x64), the other
    fp16-domain tiles, and 64 heads as two 32-head tiles. Every tile is spelled out, so a later change of
    the defaults does not change what a name measures."""
    if (H, T) not in V5_SHAPES:
        return []
    fp8, out = "fp8_ds_mla", []
    if H <= 16:
        out.append(("glm5lab-v5-reload-16x64-w4", fp8, {"_config": {"fp8_path": "reload", "block_h": 16,
                                                                     "block_n": 64, "num_warps": 4}}))
        for tag, bn, w, st in (("16x64-w8", 64, 8, 2), ("16x32-w4-s3", 32, 4, 3), ("16x32-w2", 32, 2, 2)):
            out.append((f"glm5lab-v5-f16-{tag}", fp8, {"_config": {"fp8_path": "f16", "block_h": 16, "block_n": bn,
                                                                    "num_warps": w, "num_stages": st}}))
        out.append(("glm5lab-v5-f16-16x32-w4-r168", fp8, {"_config": {"fp8_path": "f16", "block_h": 16, "block_n": 32,
                                                                       "num_warps": 4, "maxnreg": 168}}))
        if T == 128:
            out.append(("glm5lab-v5-f16-16x32-w4-sp1", fp8, {"num_splits": 1}))
    if H == 64:
        out.append(("glm5lab-v5-bf16-32x32-w4", "bf16", {"_config": {"block_h": 32, "block_n": 32, "num_warps": 4}}))
        out.append(("glm5lab-v5-f16-32x32-w8", fp8, {"_config": {"fp8_path": "f16", "block_h": 32, "block_n": 32,
                                                                  "num_warps": 8}}))
    return out


@dataclass
class Profile:
    name: str
    num_slots: int
    block_size: int
    topk: int
    heads: tuple
    tokens: tuple
    accuracy_tokens: int           # tokens per shape checked against the float64 reference
    variants: bool = True          # also time tuning variants (split/merge/tile choices)
    extra: dict = field(default_factory=dict)


PROFILES = {
    "gpu": Profile("gpu", 524_288, 64, 2048, (8, 16, 64, 128), (1, 8, 32, 128, 512), 16),
    "cpu": Profile("cpu", 2048, 64, 96, (8, 64), (1, 3), 3, variants=False),
}


def torch_gather_attention(q, kv_flat, slots, softmax_scale):
    """The straightforward torch version: gather the rows, bf16 matmuls, fp32 softmax."""
    import torch

    valid = slots >= 0
    rows = kv_flat[slots.clamp(min=0).long()]                               # [T, K, 576]
    scores = torch.einsum("thd,tkd->thk", q, rows).float() * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("thk,tkd->thd", p, rows[..., :512]), lse


def V1_CONFIG(num_heads: int) -> dict:
    """The tiles and fp8 path of kernel v1 (first H200 run), kept as a variant so every run shows what changed."""
    if num_heads <= 16:
        return {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "fp8_path": "default"}
    if num_heads <= 32:
        return {"block_h": 32, "block_n": 32, "num_warps": 4, "num_stages": 2, "fp8_path": "default"}
    return {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2, "fp8_path": "default"}


def rotating_sets(tokens: int, topk: int) -> int:
    """How many input sets a CUDA-graph timing rotates through: enough that their rows (656 bytes each) together pass
    150 MB, over twice the H200's L2, so that a replay does not find the previous call's rows there; at most 32."""
    return max(1, min(32, math.ceil(150e6 / (tokens * topk * 656))))


def input_sets(tokens: int, heads: int, topk: int, num_slots: int, n_sets: int, gen, device="cuda") -> list:
    """n_sets fresh (bf16 q [tokens, heads, 576], random slots [tokens, topk] over num_slots) input sets."""
    import torch

    return [(torch.randn(tokens, heads, 576, device=device, generator=gen).to(torch.bfloat16),
             torch.randint(0, num_slots, (tokens, topk), device=device, dtype=torch.int32, generator=gen))
            for _ in range(n_sets)]


def graph_time_us(calls, replays: int = 10, repeats: int = 5) -> float:
    """Median GPU time of one call, from CUDA-graph replays of `calls` (one call per input set, run back to
    back). No launch or Python overhead is in it: this is the time a CUDA-graph-captured engine (vLLM's
    decode) sees. Rotating input sets keep the previous call's rows out of L2."""
    return median_us(graph_timer(calls, replays), repeats)


def median_us(timer, repeats: int = 5) -> float:
    """The median of `repeats` timings of a `graph_timer`."""
    import statistics

    return statistics.median(timer() for _ in range(repeats))


def graph_timer(calls, replays: int = 10):
    """`calls` (one call per input set) captured once in a CUDA graph; returns a no-argument call that replays it
    `replays` times between two events and returns the GPU time of one call in us (`median_us` takes the median of
    a few; interleaved timing, `timing.interleaved_samples`, calls the timers of a shape's implementations in
    turn)."""
    return replay_timer(capture_graph(calls), len(calls), replays)


def replay_timer(graph, calls_a_replay: int, replays: int = 10):
    """A no-argument call that replays a captured `graph` (of `calls_a_replay` calls) `replays` times between two
    events and returns the GPU time of one call in us; it holds the graph, and so its calls (`capture_graph`)."""
    import torch

    def one_timing() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (replays * calls_a_replay)
    one_timing.graph = graph
    return one_timing


def capture_graph(calls):
    """`calls` (one call per input set) run once on a side stream (compilation, allocation), then captured in a CUDA
    graph and replayed once; returns the graph (`graph_timer`, `power_probe`), which holds the calls: a replay runs
    their kernels on whatever they hold outside the graph's memory pool (FlashMLA's callables, their scheduler
    metadata), and freed, that memory is reused by others (v41: "operation not supported on global/shared address
    space" in the suite's rounds, once a timer no longer held them)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    graph.calls = list(calls)
    return graph


def interleaved_rows(shape: str, samples: dict, min_bytes: dict, bw_gbps: float | None = None) -> tuple[list, dict]:
    """Rows of one shape's interleaved rounds (`timing.interleaved_samples`: {(implementation, layout): [us a round]})
    and {(implementation, layout): {"us", "roofline", "x_fm"}} (p50s). Per implementation: time_graph_interleaved;
    roofline_fraction_interleaved against the run's copy bandwidth `bw_gbps` (the sequential pass's denominator:
    a copy timed inside the rounds read 3-5% lower, which would flatter every kernel -- NOTES.md v21 call 2); for
    glm5lab's kernels beside FlashMLA in the same layout, speedup_vs_flashmla_interleaved = FlashMLA's time / ours,
    taken round by round so a drift of the machine between rounds cancels."""
    from glm5lab.bench.timing import paired_quantiles, quantiles

    rows, head = [], {}
    for (name, lay), xs in samples.items():
        base = {"suite": SUITE, "implementation": name, "shape": shape, "dtype": "bf16", "layout": lay}
        tq = quantiles(xs)
        rows.append({**base, "metric": "time_graph_interleaved", "value": tq["p50"], "unit": "us", **tq})
        head[(name, lay)] = {"us": tq["p50"], "roofline": float("nan"), "x_fm": float("nan")}
        if bw_gbps:
            rq = paired_quantiles(lambda t: min_bytes[lay] / (t * 1e-6) / 1e9 / bw_gbps, xs)
            rows.append({**base, "metric": "roofline_fraction_interleaved", "value": rq["p50"], "unit": "fraction",
                         **rq})
            head[(name, lay)]["roofline"] = rq["p50"]
        fm = samples.get(("flashmla", lay))
        if name.startswith("glm5lab") and fm:
            xq = paired_quantiles(lambda t, f: f / t, xs, fm)
            rows.append({**base, "metric": "speedup_vs_flashmla_interleaved", "value": xq["p50"], "unit": "x", **xq})
            head[(name, lay)]["x_fm"] = xq["p50"]
    return rows, head


def _errors(out, lse, ref_out, ref_lse, n):
    """(relative Frobenius error of out, max |lse - ref| over finite ref, max |lse/ln2... |) on n tokens."""
    import torch

    o = out[:n].double()
    rel = float((o - ref_out).norm() / ref_out.norm().clamp(min=1e-30))
    if not bool(torch.isfinite(o).all()):
        rel = float("nan")
    fin = torch.isfinite(ref_lse)
    l = lse[:n].double()
    err_ln = float((l - ref_lse)[fin].abs().max()) if bool(fin.any()) else 0.0
    err_log2 = float((l - ref_lse / math.log(2))[fin].abs().max()) if bool(fin.any()) else 0.0
    return rel, err_ln, err_log2


def timing_order(impls: list, cuda: bool) -> list:
    """(recorded, implementation) in the order a shape times them: on a GPU the first implementation is timed once
    more up front, through the whole procedure, and that timing is discarded. Why: on the H200 the first
    implementation timed in a shape came out 8-10% slower than the same kernel and config timed later in the
    shape (NOTES.md v8 and v9: bf16 8 heads x 128 tokens 91.3 vs 84.1 us), and 0.2 s of eager calls before the
    timing did not remove it; the cause is not known."""
    return ([(False, impls[0])] if cuda and impls else []) + [(True, i) for i in impls]


def gluon_variant_runs(name: str, num_heads: int, layout: str) -> bool:
    """Whether the GLUON_VARIANTS tile `name` applies: 16-head tiles at <= 16 heads (8-head ones at <= 8), the 64-head
    wgmma tiles beyond (its fp8_ds_mla form takes 64-row steps only); the tiles of VARIANT_FP8_ONLY to their kind of
    cache."""
    cfg = dict(GLUON_VARIANTS)[name]
    if cfg.get("block_h") == 8 and num_heads > 8:     # (8-head tiles: <= 8 heads)
        return False
    wide = cfg.get("block_h", 16) == 64
    if wide != (num_heads > 16):
        return False
    if name in VARIANT_FP8_ONLY:
        return VARIANT_FP8_ONLY[name] == (layout == "fp8_ds_mla")
    return not (wide and layout == "fp8_ds_mla" and cfg["block_n"] != 64)


LAYOUTS = ("bf16", "fp8_ds_mla")


def parse_tile(name: str) -> dict:
    """ "64x16w8" -> the Triton kernel's _config at 64 heads x 16 rows a step on 8 warps (2 pipeline stages)."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)", name)
    if not m:
        raise Glm5labError(f"tile {name!r}: expected <block_h>x<block_n>w<warps>, e.g. 64x16w8")
    block_h, block_n, warps = map(int, m.groups())
    return {"impl": "triton", "block_h": block_h, "block_n": block_n, "num_warps": warps, "num_stages": 2}


def parse_named_config(text: str) -> tuple[str, dict]:
    """ 'n16={"impl": "triton", "block_n": 16}' -> ("n16", that _config)."""
    name, sep, body = text.partition("=")
    try:
        cfg = json.loads(body) if sep and name else None
    except json.JSONDecodeError as exc:
        raise Glm5labError(f"config {text!r}: {exc}") from None
    if not isinstance(cfg, dict):
        raise Glm5labError(f"config {text!r}: expected NAME={{...}}, a name and a JSON object")
    return name, cfg


# GPUs whose default tiles differ from Hopper's (NOTES.md v53), by the capability default_config_for is told:
# "sm120" stands for every ~100 KB-shared-memory GPU (SM86 / SM89 / SM120 take the same tile), "sm100" for SM100/103
OTHER_GPU_TILES = {"sm120": (12, 0), "sm100": (10, 0)}


def run(csv_path, profile: str = "gpu", *, heads=None, tokens=None, command: str = "", verbose: bool = True,
        fp8_v4: bool | None = None, v5: bool | None = None, variants: bool | None = None, skip=(),
        fused_merge: bool = False, gluon: bool = False, interleave: int = 0, interleave_impls: tuple | None = None,
        layouts: tuple = LAYOUTS, other_gpu_tiles: bool = False, tiles: tuple = (), configs: dict | None = None):
    """Run the benchmark for `profile` ("gpu" or "cpu"), append rows to csv_path, return a summary
    pandas DataFrame (one row per implementation x shape). fp8_v4 (default: env GLM5LAB_BENCH_FP8_V4=1) adds
    the v4 fp8 paths at FP8_V4_SHAPES. gluon adds the Gluon kernels (sparse_mla_sm90) in the GLUON_VARIANTS tiles
    (those named in env GLM5LAB_BENCH_GLUON, default all): 16-head tiles at <= 16 heads, wgmma tiles beyond.
    interleave (GPU only): after a shape's implementations are timed one after another, time their CUDA graphs
    again in that many interleaved rounds (`interleaved_rows`: metrics
    time_graph_interleaved, roofline_fraction_interleaved, speedup_vs_flashmla_interleaved); interleave_impls names
    the implementations taken into the rounds (default: every CUDA-graph-timed one). layouts: the cache layouts
    timed (default both; an A/B of fp8_ds_mla kernels compiles half as much with ("fp8_ds_mla",)). other_gpu_tiles:
    also the Triton kernel at the bf16 tiles other GPUs take by default where they differ from this one's
    (OTHER_GPU_TILES, "glm5lab-triton-<gpu>-tile" rows): that tile's cost on THIS GPU, not a measurement of that GPU.
    tiles: Triton tiles to time beside the default, as "<block_h>x<block_n>w<warps>" (`parse_tile`; rows
    "glm5lab-triton-<tile>"). configs: {name: _config} timed beside the default (rows "glm5lab-<name>")."""
    import os

    import pandas as pd
    import torch

    from glm5lab.bench import flashmla_anchor
    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import bench, copy_bandwidth_gbps, interleaved_samples, pick_profile
    from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
    from glm5lab.kernels.host import sm_count
    from glm5lab.kernels.sparse_mla import (_gluon_by_default, choose_num_splits, default_config,
                                            default_config_for, resident_ctas, sparse_mla_attention, sparse_mla_flops,
                                            sparse_mla_min_bytes)
    from glm5lab.sparse.reference import mla_softmax_scale, sparse_mla_reference

    prof, dev = pick_profile(PROFILES, profile)
    cuda = dev == "cuda"
    heads = tuple(heads or prof.heads)
    if fp8_v4 is None:
        fp8_v4 = os.environ.get(FP8_V4_ENV, "0") not in ("", "0")
    if v5 is None:
        v5 = os.environ.get(V5_ENV, "0") not in ("", "0")
    if variants is None:
        variants = prof.variants
    tokens = tuple(tokens or prof.tokens)
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    unknown = set(layouts) - set(LAYOUTS)
    if unknown or not layouts:
        raise Glm5labError(f"layouts {sorted(unknown) or '(none)'}: expected some of {LAYOUTS}")
    gluon_tiles = gluon_variants(os.environ.get(GLUON_ENV, "")) if gluon else []
    named_configs = [(f"triton-{name}", parse_tile(name)) for name in tiles] + list((configs or {}).items())
    log = (lambda *a: print(*a, flush=True)) if verbose else (lambda *a: None)

    gen = torch.Generator(device=dev).manual_seed(1234)
    nblocks = prof.num_slots // prof.block_size
    kv = torch.randn(nblocks, prof.block_size, 576, device=dev, dtype=torch.float32, generator=gen)
    kv_bf16 = kv.to(torch.bfloat16)
    del kv
    kv_fp8 = quantize_fp8_ds_mla(kv_bf16)
    kv_fp8_deq = dequantize_fp8_ds_mla(kv_fp8)                  # float32: exactly what the kernels read
    kv_flat = kv_bf16.view(-1, 576)
    scale = mla_softmax_scale()
    bw = copy_bandwidth_gbps()
    log(f"device {torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}; copy bandwidth "
        f"{bw:.0f} GB/s" if bw else "no GPU: copy bandwidth not measured, timings are interpreter wall clock")

    anchor_ok, anchor_why = False, ""
    if cuda:
        try:
            flashmla_anchor.load()
            anchor_ok = True
        except Glm5labError as exc:
            anchor_why = str(exc)
    else:
        anchor_why = "no GPU"
    if not anchor_ok:
        log(f"FlashMLA anchor skipped: {anchor_why}")

    try:
        from glm5lab.sparse.virtual_block_table import virtual_block_table_attention as vbt_attention
    except ImportError as exc:
        vbt_attention = None
        log(f"virtual-block-table route skipped: {exc}")

    rows, summary = [], []
    if bw:
        rows.append({"suite": SUITE, "implementation": "copy", "shape": "2GiB", "dtype": "uint8", "layout": "-",
                     "metric": "copy_bandwidth", "value": bw, "unit": "GB/s"})

    for H in heads:
        for T in tokens:
            shape = f"H{H}_T{T}_K{prof.topk}"
            # input sets: set 0 for accuracy and do_bench; all of them (distinct rows, > 2x the L2 together)
            # for the CUDA-graph replay time, so replays do not find the previous call's rows in L2
            sets = input_sets(T, H, prof.topk, prof.num_slots, rotating_sets(T, prof.topk) if cuda else 1, gen, dev)
            q, slots = sets[0]
            n_acc = min(T, prof.accuracy_tokens)
            ref = {}
            for lay, cache in (("bf16", kv_bf16), ("fp8_ds_mla", kv_fp8_deq)):
                if lay in layouts:
                    ref[lay] = sparse_mla_reference(q[:n_acc], cache, slots[:n_acc], scale)

            impls = []   # (name, layout, factory(q, slots) -> zero-argument call, time it in a CUDA graph?)
            caches = {"bf16": kv_bf16, "fp8_ds_mla": kv_fp8}

            def call(q, slots, cache, **kw):
                return lambda: sparse_mla_attention(q, cache, slots, scale, **kw)
            for lay, cache in caches.items():
                make = functools.partial(call, cache=cache)
                impls.append(("glm5lab", lay, make, True))
                if cuda and _gluon_by_default(q, lay == "fp8_ds_mla", H, "auto", None):
                    # "glm5lab" runs the Gluon kernel here: the Triton kernel beside it (NOTES.md v7)
                    impls.append(("glm5lab-triton", lay, functools.partial(make, _config={"impl": "triton"}), True))
                for gpu, capability in OTHER_GPU_TILES.items() if other_gpu_tiles else ():
                    tile = default_config_for(H, lay == "fp8_ds_mla", capability)
                    if tile != default_config(H, lay == "fp8_ds_mla", q.device):
                        impls.append((f"glm5lab-triton-{gpu}-tile", lay,
                                      functools.partial(make, _config={**tile, "impl": "triton"}), True))
                for name, cfg in named_configs:
                    impls.append((f"glm5lab-{name}", lay, functools.partial(make, _config=cfg), True))
                if fused_merge and not variants:   # the one-launch merge beside the default (NOTES.md v6)
                    impls.append(("glm5lab-fused-merge", lay, functools.partial(make, merge="fused"), True))
                for g_name, g_cfg in gluon_tiles:   # NOTES.md v7, v8
                    if not gluon_variant_runs(g_name, H, lay):
                        continue
                    impls.append((f"glm5lab-gluon-{g_name}", lay,
                                  functools.partial(make, _config={"impl": "gluon", **g_cfg}), True))
                if fp8_v4 and lay == "fp8_ds_mla":
                    for v4_name, v4_cfg in fp8_v4_variants(H, T):
                        impls.append((v4_name, lay, functools.partial(make, _config=v4_cfg), True))
                if variants:
                    fp8 = lay == "fp8_ds_mla"
                    cfg = default_config(H, fp8, q.device)
                    tiles = math.ceil(H / cfg["block_h"])
                    splits = choose_num_splits(T, tiles, prof.topk, cfg["block_n"], sm_count(q.device),
                                               resident_ctas(cfg["block_h"]))
                    impls.append(("glm5lab-v1-tiles", lay, functools.partial(make, _config=V1_CONFIG(H)), True))
                    if fp8:   # sm90 SASS: the pipelined fp8 tiles are read from shared memory a byte at a time
                        impls.append(("glm5lab-stages1", lay, functools.partial(make, _config={"num_stages": 1}), True))
                    if splits > 1:
                        impls.append(("glm5lab-fused-merge", lay, functools.partial(make, merge="fused"), True))
                        impls.append(("glm5lab-no-split", lay, functools.partial(make, num_splits=1), True))
                    if H == 8 and T <= 32:
                        for n in (2, 4, 8, 16, 32):
                            if n != splits:
                                impls.append((f"glm5lab-s{n}", lay, functools.partial(make, num_splits=n), True))
            if v5:
                for v5_name, lay, kw in v5_variants(H, T):
                    impls.append((v5_name, lay, functools.partial(call, cache=caches[lay], **kw), True))
            if anchor_ok:
                impls.append(("flashmla", "fp8_ds_mla",
                              lambda q, slots: flashmla_anchor.SparseDecodeFP8(q, kv_fp8, slots, scale), True))
                impls.append(("flashmla", "bf16",
                              lambda q, slots: flashmla_anchor.SparsePrefillBF16(q, kv_bf16, slots, scale), True))
            if vbt_attention is not None:   # issue 6's route: dense paged kernel on a virtual block table
                impls.append(("virtual-block-table", "bf16",
                              lambda q, slots: lambda: vbt_attention(q, kv_bf16, slots, scale, validate=False), False))
            impls.append(("torch-gather", "bf16",
                          lambda q, slots: lambda: torch_gather_attention(q, kv_flat, slots, scale), False))

            min_bytes = {lay: sparse_mla_min_bytes(T, H, prof.topk, lay) for lay in ("bf16", "fp8_ds_mla")}
            flops = sparse_mla_flops(T, H, prof.topk)
            impls = [i for i in impls if i[0] not in skip and i[1] in layouts]
            graph_timers = {}    # (name, layout) -> the graph its time was taken from, for interleaved rounds
            shape_recs = {}      # ... and its summary record, which takes the rounds' p50s
            for recorded, (name, lay, factory, graphable) in timing_order(impls, cuda):
                g_warm = g_timer = None      # (the previous implementation's graph goes, unless kept for rounds)
                try:
                    fn = factory(q, slots)
                    out, lse = fn()
                    rel, e_ln, e_log2 = _errors(out, lse, *ref[lay], n_acc)
                    t = bench(fn)
                    g_timer = graph_timer([fn] + [factory(*st) for st in sets[1:]]) if (cuda and graphable) else None
                    g_us = median_us(g_timer) if g_timer else None
                    if cuda and graphable and T <= 8 and name in ("glm5lab", "flashmla"):
                        g_warm = graph_time_us([fn])   # one input set replayed: its rows stay in L2 (warm)
                except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
                    log(f"  {shape} {name} {lay}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                if not recorded:
                    continue
                us = t["p50"]
                base = {"suite": SUITE, "implementation": name, "shape": shape, "dtype": "bf16", "layout": lay}
                eff = min_bytes[lay] / (us * 1e-6) / 1e9
                rec = {"impl": name, "layout": lay, "H": H, "T": T, "us": us, "eff_GBps": eff,
                       "roofline": eff / bw if bw else float("nan"), "tflops": flops / (us * 1e-6) / 1e12,
                       "rel_err": rel, "lse_err_ln": e_ln, "lse_err_log2": e_log2,
                       "min_bytes": min_bytes[lay], "flops": flops}
                summary.append(rec)
                if interleave and g_timer is not None and (interleave_impls is None or name in interleave_impls):
                    graph_timers[(name, lay)] = g_timer     # (kept: the graph is not captured again)
                    shape_recs[(name, lay)] = rec
                rows.append({**base, "metric": "time", "value": us, "unit": "us", **t})
                rows.append({**base, "metric": "effective_bandwidth", "value": eff, "unit": "GB/s"})
                if bw:
                    rows.append({**base, "metric": "roofline_fraction", "value": eff / bw, "unit": "fraction"})
                rows.append({**base, "metric": "tflops", "value": rec["tflops"], "unit": "TFLOP/s"})
                rec["graph_us"] = g_us if g_us is not None else float("nan")
                rec["graph_warm_us"] = g_warm if g_warm is not None else float("nan")
                if g_warm is not None:
                    rows.append({**base, "metric": "time_graph_warm_l2", "value": g_warm, "unit": "us"})
                if g_us is not None:
                    rows.append({**base, "metric": "time_graph", "value": g_us, "unit": "us"})
                    if bw:
                        rows.append({**base, "metric": "roofline_fraction_graph",
                                     "value": min_bytes[lay] / (g_us * 1e-6) / 1e9 / bw, "unit": "fraction"})
                rows.append({**base, "metric": "rel_err_out", "value": rel, "unit": "rel_frobenius"})
                rows.append({**base, "metric": "lse_err_ln", "value": e_ln, "unit": "abs"})
                rows.append({**base, "metric": "lse_err_log2", "value": e_log2, "unit": "abs"})
                rows.append({**base, "metric": "min_bytes", "value": min_bytes[lay], "unit": "B"})
                rows.append({**base, "metric": "flops", "value": flops, "unit": "FLOP"})
                warm = f"  warm-L2 {g_warm:6.1f} us" if g_warm is not None else ""
                log(f"  {shape:16s} {name:24s} {lay:10s} {us:9.1f} us  graph {rec['graph_us']:8.1f} us{warm}  "
                    f"roofline {rec['roofline']:.2f}  "
                    f"{rec['tflops']:6.1f} TF/s  err {rel:.1e}  lse {min(e_ln, e_log2):.1e}")
            if graph_timers:
                ilv_rows, head = interleaved_rows(shape, interleaved_samples(graph_timers, interleave), min_bytes, bw)
                rows += ilv_rows
                for key, h in head.items():
                    shape_recs[key].update({f"ilv_{k}": v for k, v in h.items()})
                    log(f"  {shape:16s} {key[0]:24s} {key[1]:10s} interleaved graph {h['us']:8.1f} us  "
                        f"roofline {h['roofline']:.2f}  x FM {h['x_fm']:.2f}  ({interleave} rounds)")
            del q, slots, impls, sets, graph_timers, shape_recs
            if cuda:
                torch.cuda.empty_cache()

    df = pd.DataFrame(summary)
    if not df.empty:
        fm = df[df.impl == "flashmla"].set_index(["layout", "H", "T"])["us"]
        df["vs_flashmla"] = [fm.get((r.layout, r.H, r.T), float("nan")) / r.us for r in df.itertuples()]
        for r in df[df.impl.str.startswith("glm5lab")].itertuples():
            if not math.isnan(r.vs_flashmla):
                rows.append({"suite": SUITE, "implementation": r.impl, "shape": f"H{r.H}_T{r.T}_K{prof.topk}",
                             "dtype": "bf16", "layout": r.layout, "metric": "speedup_vs_flashmla",
                             "value": r.vs_flashmla, "unit": "x"})
    append_rows(csv_path, rows, command=command or f"kernel_bench profile={profile}")
    if verbose and not df.empty:
        df.attrs["copy_bw_GBps"] = bw
        print_table(df)
        if cuda:
            print_table(df, "graph_us", "CUDA-graph replay (GPU time only, rotating inputs)")
        if "ilv_us" in df:
            print_interleaved_table(df, interleave)
        if fp8_v4:
            print_variant_table(df, "glm5lab-fp8-v4", "fp8_ds_mla v4 paths (diag rows: wrong results by design)",
                                fp8_only=True)
        if v5:
            print_variant_table(df, "glm5lab-v5", "v5 variants")
    return df


def print_variant_table(df, prefix: str, title: str, fp8_only: bool = False) -> None:
    """Variants whose name starts with `prefix` beside the default kernel of their layout and FlashMLA, per shape:
    CUDA-graph time when measured (else do_bench), x def = default time / this, roofline fraction, error."""
    v = df[df.impl.str.startswith(prefix) | df.impl.isin(["glm5lab", "flashmla"])]
    if fp8_only:
        v = v[v.layout == "fp8_ds_mla"]
    if v.empty or not v.impl.str.startswith(prefix).any():
        return
    col = "graph_us" if v["graph_us"].notna().any() else "us"
    print(f"\n{title} ({col}); x def = default time / this")
    for (H, T, lay), g in v.groupby(["H", "T", "layout"]):
        if not g.impl.str.startswith(prefix).any():
            continue
        base = g[g.impl == "glm5lab"][col]
        base = float(base.iloc[0]) if len(base) else float("nan")
        for r in g.sort_values(col).itertuples():
            t = getattr(r, col)
            print(f"  H{H:<3} T{T:<4} {lay:10s} {r.impl:34s} {t:9.1f} us  x def {base / t:5.2f}  "
                  f"roof {r.roofline:.2f}  err {r.rel_err:.1e}")


def print_interleaved_table(df, rounds: int) -> None:
    """glm5lab's default kernel vs FlashMLA from the interleaved rounds: p50 us, and the p50 of the round-by-round
    roofline fraction and ratio to FlashMLA."""
    d = df[df.impl.isin(["glm5lab", "flashmla"]) & df["ilv_us"].notna()]
    if d.empty:
        return
    t = {(r.impl, r.layout, r.H, r.T): r for r in d.itertuples()}
    print(f"\nsparse MLA, CUDA-graph time in {rounds} interleaved rounds: us; roof = fraction of the memory roofline "
          "(the run's copy bandwidth); x FM = FlashMLA time / ours, round by round")
    print(f"{'H':>4} {'T':>4} | {'g5 bf16':>8} {'roof':>5} {'FM bf16':>8} {'x FM':>5} | "
          f"{'g5 fp8':>8} {'roof':>5} {'FM fp8':>8} {'x FM':>5}")
    nan = float("nan")
    for H, T in sorted({(r.H, r.T) for r in d.itertuples()}):
        cells = []
        for lay in ("bf16", "fp8_ds_mla"):
            g, f = t.get(("glm5lab", lay, H, T)), t.get(("flashmla", lay, H, T))
            cells.append(f"{g.ilv_us if g else nan:8.1f} {g.ilv_roofline if g else nan:5.2f} "
                         f"{f.ilv_us if f else nan:8.1f} {g.ilv_x_fm if g else nan:5.2f}")
        print(f"{H:>4} {T:>4} | {cells[0]} | {cells[1]}")


def print_table(df, col: str = "us", title: str = "do_bench p50 (events, L2 flushed, launch overhead included)") -> None:
    """Short table: glm5lab's default kernel vs FlashMLA per shape and layout."""
    nan = float("nan")
    t = {(r.impl, r.layout, r.H, r.T): getattr(r, col) for r in df.itertuples()}
    mb = {(r.layout, r.H, r.T): r.min_bytes for r in df.itertuples()}
    bw = df.attrs.get("copy_bw_GBps") or nan
    print(f"\nsparse MLA, {title}: us; roof = fraction of the memory roofline; x FM = FlashMLA time / ours")
    print(f"{'H':>4} {'T':>4} | {'g5 bf16':>8} {'roof':>5} {'FM bf16':>8} {'x FM':>5} | "
          f"{'g5 fp8':>8} {'roof':>5} {'FM fp8':>8} {'x FM':>5} | {'VBT':>8} {'torch':>8}")
    for H, T in sorted({(r.H, r.T) for r in df.itertuples()}):
        cells = []
        for lay in ("bf16", "fp8_ds_mla"):
            g, f = t.get(("glm5lab", lay, H, T), nan), t.get(("flashmla", lay, H, T), nan)
            roof = mb.get((lay, H, T), nan) / (g * 1e-6) / 1e9 / bw
            cells.append(f"{g:8.1f} {roof:5.2f} {f:8.1f} {f / g:5.2f}")
        print(f"{H:>4} {T:>4} | {cells[0]} | {cells[1]} | {t.get(('virtual-block-table', 'bf16', H, T), nan):8.1f} "
              f"{t.get(('torch-gather', 'bf16', H, T), nan):8.1f}")


@one_line_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm5lab.bench.kernel_bench", description=first_paragraph(__doc__))
    p.add_argument("--out", required=True, help="CSV to append long-format rows to")
    p.add_argument("--profile", default=None, help="gpu or cpu (default: gpu when CUDA is present)")
    p.add_argument("--heads", type=int, nargs="*", default=None)
    p.add_argument("--tokens", type=int, nargs="*", default=None)
    p.add_argument("--summary", default=None, help="also write the per-shape summary table to this CSV")
    p.add_argument("--fp8-v4", action="store_true", default=None,
                   help=f"also time the v4 fp8 paths (NOTES.md) at H8 T128, H8 T512, H64 T512 (env {FP8_V4_ENV}=1)")
    p.add_argument("--v5", action="store_true", default=None,
                   help=f"also time the v5 variants (NOTES.md) at V5_SHAPES (env {V5_ENV}=1)")
    p.add_argument("--no-variants", action="store_true", help="skip the older tuning variants (v1 tiles, splits)")
    p.add_argument("--skip", nargs="*", default=(), help="implementations not to run, e.g. torch-gather")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="cache layouts to time")
    p.add_argument("--fused-merge", action="store_true", help="also time merge='fused' beside the default merge")
    p.add_argument("--gluon", action="store_true", help="also time the Gluon kernels (GLUON_VARIANTS)")
    p.add_argument("--other-gpu-tiles", action="store_true",
                   help="also time the Triton kernel at the tiles other GPUs take (OTHER_GPU_TILES), on this GPU")
    p.add_argument("--tiles", nargs="+", default=(), metavar="HxNwW",
                   help="also time the Triton kernel at these tiles, e.g. 64x16w8 32x32w4 (heads x rows a step, warps)")
    p.add_argument("--config", nargs="+", default=(), metavar="NAME=JSON", type=parse_named_config,
                   help="also time sparse_mla_attention with this _config, e.g. 'n16={\"impl\": \"triton\", "
                        "\"block_n\": 16}' (rows glm5lab-NAME)")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="GPU: also time each shape's CUDA graphs in ROUNDS interleaved rounds (metric "
                        "time_graph_interleaved), for A/B differences of a few percent")
    args = p.parse_args(argv)
    if args.interleave < 0:
        p.error(f"--interleave takes a number of rounds >= 0, got {args.interleave}")
    for flag, values in (("--heads", args.heads), ("--tokens", args.tokens)):
        if values is not None and (not values or min(values) < 1):
            raise Glm5labError(f"{flag} takes numbers >= 1, got {values}")
    import torch

    profile = args.profile or ("gpu" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    df = run(args.out, profile, heads=args.heads, tokens=args.tokens,
             command=command_line("glm5lab.bench.kernel_bench", argv),
             fp8_v4=args.fp8_v4, v5=args.v5, variants=False if args.no_variants else None, skip=tuple(args.skip),
             fused_merge=args.fused_merge, gluon=args.gluon, interleave=args.interleave,
             layouts=tuple(args.layouts), other_gpu_tiles=args.other_gpu_tiles, tiles=tuple(args.tiles),
             configs=dict(args.config))
    if args.summary:   # with the provenance of the rows it summarizes (the run just appended to --out)
        from glm5lab.bench.records import write_summary

        write_summary(df, args.out, args.summary)
    print(f"done in {time.time() - t0:.0f} s; rows appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
