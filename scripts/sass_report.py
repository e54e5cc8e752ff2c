"""Offline GPU build of the sparse-MLA kernel, no GPU needed: registers, spills, shared memory and the
instruction mix of the main loop, per configuration (the method behind results/kernels/NOTES.md v4/v5).

Triton compiles for any NVIDIA target on a CPU machine with its bundled ptxas; cuobjdump (also bundled) reads
the cubin. The main loop is the longest backward branch of the SASS (`backward_spans`; step_loop: the longest
conditional one).

    PYTHONPATH=. python scripts/sass_report.py --sm 90 \
        --config '{"BLOCK_H": 16, "BLOCK_N": 32, "FP8": true, "F16": true, "CVT": 1, "num_warps": 4}'
    PYTHONPATH=. python scripts/sass_report.py --defaults      # the default tile of each head count and layout
    PYTHONPATH=. python scripts/sass_report.py --config '{"gluon": true, "BLOCK_H": 16, "BLOCK_N": 32, "STAGES": 2,
        "SPLIT": false}'            # a Gluon kernel of sparse_mla_sm90 (fp8; "FP8": false for bf16/fp16;
                                    # "BLOCK_H": 64 with "num_warps": 8: the wgmma kernel; "rows": true with
                                    # "BLOCK_N": 64: the rows-as-M kernels; "ws": true with "BLOCK_H": 64:
                                    # the warp-specialized 64-head kernel)
    PYTHONPATH=. python scripts/sass_report.py --config '{"tma_probe": true, "plan": "rows3"}'   # the TMA gather
                                    # probe's kernel (glm5lab.bench.tma_gather_probe)
    PYTHONPATH=. python scripts/sass_report.py --config '{"indexer_logits": true, "KEYS_AS_M": true, "FP8_DOT": true}'
                                    # the indexer's decode logits kernel (INDEXER_DEFAULTS: 32 heads, 128 fp8 keys)
    PYTHONPATH=. python scripts/sass_report.py --config '{"indexer_prefill": true, "KEYS_AS_M": true}'
                                    # its prefill logits kernel (PREFILL_DEFAULTS: 4 tokens x 32 heads, e4m3 q on
                                    # 64-key tiles of the fp8 pair, 16 a program, 3 stages: Hopper's tiling)

--dump DIR keeps sass.txt / ttgir.txt / ptx.txt of each configuration; --json prints one JSON object a line.
Run it as a script (it turns the Triton interpreter off for its own process before glm5lab's kernels load).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # a real build, even when the shell has the interpreter on

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

KEYS = ["HMMA", "HGMMA", "QMMA", "QGMMA", "LDGSTS", "LDG", "LDS", "LDS.U8", "LDS.U16", "LDS.128", "LDSM", "STS",
        "LDL", "STL", "F2FP", "F2F", "PRMT", "FMUL", "FFMA", "HMUL2", "HADD2", "MUFU", "SHFL", "REDUX", "BAR",
        "WARPGROUP.DEPBAR", "UTMALDG"]
KERNEL_DEFAULTS = {"SPLIT": False, "FUSED_MERGE": True, "UPCAST": False, "RELOAD": False, "FP8_DIAG": 0,
                   "WORDS": False, "F16": False, "CVT": 1, "S_PAD": 1}
POINTERS = {"SLOTS": "*i32", "STAMPS": "*i64", "LSE": "*fp32", "PART_O": "*fp32", "PART_LSE": "*fp32",
            "COUNTER": "*i32", "qk_scale_log2": "fp32"}
ALIGNED = ("stride_qt", "stride_qh", "kv_row_stride", "stride_st", "stride_ot", "stride_oh", "rows_per_split")


def build(config: dict, sm: int = 90):
    """Compile _sparse_mla_fwd_kernel (or, with "gluon": true, the Gluon kernel of sparse_mla_sm90 that
    kernel_of picks for "BLOCK_H", "FP8" (default true) and "rows") for sm_<sm> with the constexprs and options in
    `config`."""
    cfg = dict(config)
    if cfg.pop("tma_probe", False):       # glm5lab.bench.tma_gather_probe's kernel ("plan", "check")
        from glm5lab.bench import tma_gather_probe

        src, opts = tma_gather_probe.offline_source(**cfg)
        return triton.compile(src, target=GPUTarget("cuda", sm, 64 if sm >= 90 else 32), options=opts)
    if cfg.pop("indexer_logits", False):  # the indexer's decode logits kernel (glm5lab.kernels.dsa_indexer)
        return _build_indexer_logits(cfg, sm)
    if cfg.pop("indexer_prefill", False):  # the indexer's prefill logits kernel
        return _build_indexer_logits(cfg, sm, prefill=True)
    gluon = cfg.pop("gluon", False)
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source

        from glm5lab.kernels import sparse_mla_sm90
        cfg.setdefault("FP8", True)          # (not a parameter: it picks the kernel and the cache pointer below)
        kern = sparse_mla_sm90.kernel_of(cfg.get("BLOCK_H", 16), cfg["FP8"], cfg.pop("rows", False),
                                         cfg.pop("ws", False), cfg.pop("converter", False), cfg.pop("dual", False),
                                         cfg.pop("one_item", False), cfg.pop("paired", False))
    else:
        Source = ASTSource
        from glm5lab.kernels.sparse_mla import _sparse_mla_fwd_kernel as kern

    opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in cfg}
    if gluon:
        opts = {**sparse_mla_sm90.build_options(kern), **opts}      # (as `launch` builds it)
    opts.setdefault("num_warps", 4)
    opts.setdefault("num_stages", 2)
    qdt = cfg.pop("q_dtype", "bf16")
    stamps = cfg.pop("STAMPS", False)       # true: the phase stamps' buffer (a pointer); else None, as by default
    consts = ({**KERNEL_DEFAULTS, **cfg} if not gluon
              else {k: v for k, v in cfg.items() if k != "FP8" or "FP8" in kern.arg_names})
    if "STAMPS" in kern.arg_names and not stamps:
        consts["STAMPS"] = None
    for param in kern.params:   # a constexpr left out would be built as a runtime argument (its branches kept)
        if param.is_constexpr and param.name not in consts:
            if not param.has_default:
                raise SystemExit(f"constexpr {param.name} needs a value in --config")
            consts[param.name] = param.default
    names = list(kern.arg_names)
    unknown = set(consts) - set(names)
    if unknown:
        raise SystemExit(f"not constexprs of the kernel: {sorted(unknown)}")
    ptr = {"Q": f"*{qdt}", "OUT": f"*{qdt}", "KV": "*u8" if cfg.get("FP8") else f"*{qdt}", **POINTERS,
           **({"PART_O": "*fp16"} if cfg.get("PART_F16") else {})}
    sig = {n: "constexpr" if n in consts else ptr.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in ALIGNED}
    src = Source(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", sm, 64 if sm >= 90 else 32), options=opts)


# the decode logits kernel at GLM-5's indexer (32 heads x 128, page 64), one 128-key fp8 tile a program with q . k^T
INDEXER_DEFAULTS = {"H": 32, "D": 128, "HP": 32, "DP": 128, "PAGE": 64, "BLOCK_N": 128, "TILES": 1, "STAGES": 1,
                    "FP8": True, "IEEE": False, "SOFT_FP8": False, "F16": False, "KEYS_AS_M": False, "PERMUTE_D": False,
                    "FP8_DOT": False}


# the prefill logits kernel as glm5lab's vLLM op runs it on Hopper (v59, v61): 4 tokens x 32 heads a q tile, 64
# keys of the gathered fp8 pair a tile, the e4m3 q's fp8 x fp8 dot, 16 key tiles a program with 3 in flight (so the
# loop is the key loop; the dot order is the config's: "KEYS_AS_M": true is Hopper's)
PREFILL_DEFAULTS = {"H": 32, "D": 128, "HP": 32, "DP": 128, "BLOCK_M": 4, "BLOCK_N": 64, "TILES": 16, "STAGES": 3,
                    "IEEE": False, "FP8": True, "SOFT_FP8": False, "FP8_DOT": True, "KEYS_AS_M": False}


def _build_indexer_logits(cfg: dict, sm: int, prefill: bool = False):
    """_decode_logits_kernel (prefill: _prefill_logits_kernel) with INDEXER_DEFAULTS (PREFILL_DEFAULTS) overridden by
    `cfg` ("q_dtype": "bf16" by default, "fp8e4nv" with FP8_DOT), every pointer and stride 16-aligned as the
    indexer's launches are."""
    from glm5lab.kernels import dsa_indexer

    kern = dsa_indexer._prefill_logits_kernel if prefill else dsa_indexer._decode_logits_kernel
    opts = {"num_warps": cfg.pop("num_warps", 4)}
    qdt = cfg.pop("q_dtype", "fp8e4nv" if cfg.get("FP8_DOT", prefill) else "bf16")
    consts = {**(PREFILL_DEFAULTS if prefill else INDEXER_DEFAULTS), **cfg}
    unknown = set(consts) - set(kern.arg_names)
    if unknown:
        raise SystemExit(f"not constexprs of the kernel: {sorted(unknown)}")
    ptr = {"Q": f"*{qdt}", "W": "*fp32", "K": "*u8" if consts["FP8"] else f"*{qdt}", "KSCALE": "*fp32", "BT": "*i32",
           "SEQ": "*i32", "OUT": "*fp32", "KS": "*i32", "KE": "*i32"}
    names = list(kern.arg_names)
    sig = {n: "constexpr" if n in consts else ptr.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts}
    src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", sm, 64 if sm >= 90 else 32), options=opts)


def backward_spans(ins: list) -> tuple:
    """(first, last) addresses, in (address, text) SASS, of the longest backward branch (the report's "loop", whose
    instruction mix it counts) and of the longest conditional one ("step_loop"; None without one). In the
    warp-specialized kernels the two differ: an mbarrier wait's out-of-line retry block ends in an unconditional
    jump back to the wait, so "loop" spans nearly every partition's code, while "step_loop" is one partition's own
    loop -- the consumer's step in the paired 16-head kernel, 1,182 instructions against a "loop" of 2,834 (NOTES.md
    v39)."""
    spans = {"any": None, "conditional": None}
    for addr, text in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        span = (int(m.group(1), 16), addr)
        for key in ("any", "conditional") if text.lstrip().startswith("@") else ("any",):
            if spans[key] is None or span[1] - span[0] > spans[key][1] - spans[key][0]:
                spans[key] = span
    return spans["any"], spans["conditional"]


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What Triton's bundled cuobjdump prints for this cubin with these flags."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """Registers a thread and stack bytes (spills and local arrays) of a cubin's kernel."""
    usage = dict(re.findall(r"(REG|STACK):(\d+)", cuobjdump(cubin, "-res-usage")))
    return {"regs": int(usage.get("REG", 0)), "stack": int(usage.get("STACK", 0))}


def report(compiled) -> dict:
    """Registers / stack / shared memory, the kernel's instruction count, and the instruction counts of its main
    loop ("counted": "loop") or, in a kernel without one (the indexer's one-tile programs), of the whole kernel
    ("kernel")."""
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]+)\*/\s+(.*?);", sass)]
    loop, step = backward_spans(ins)
    body = [t for a, t in ins if loop and loop[0] <= a <= loop[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body or [t for _, t in ins])

    def count(key):
        if key == "LDS":
            return sum(v for o, v in ops.items() if o.startswith("LDS") and not o.startswith("LDSM"))
        return sum(v for o, v in ops.items() if o == key or o.startswith(key + "."))

    regions = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                   compiled.asm["ptx"])})   # warp-specialized: registers a region
    return {**resource_usage(compiled.asm["cubin"]), "smem": compiled.metadata.shared, "instructions": len(ins),
            "loop": len(body), "counted": "loop" if body else "kernel",
            "step_loop": sum(1 for a, _ in ins if step and step[0] <= a <= step[1]),
            **{k: count(k) for k in KEYS if count(k)},
            **({"setmaxnreg": regions} if regions else {}), "_sass": sass}


def default_configs() -> list:
    from glm5lab.kernels.sparse_mla import FP8_PATHS, default_config

    out = []
    for heads in (8, 32, 64):
        for fp8 in (False, True):
            c = default_config(heads, fp8)
            reload, diag, words, f16 = FP8_PATHS[c.get("fp8_path", "default")] if fp8 else (False, 0, False, False)
            out.append({"BLOCK_H": c["block_h"], "BLOCK_N": c["block_n"], "FP8": fp8, "RELOAD": reload,
                        "FP8_DIAG": diag, "WORDS": words, "F16": f16, "num_warps": c["num_warps"],
                        "num_stages": c["num_stages"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--sm", type=int, default=90, help="target compute capability x10 (80, 89, 90, 120, ...)")
    p.add_argument("--config", action="append", default=[], help="JSON object: kernel constexprs + options")
    p.add_argument("--defaults", action="store_true", help="the default tile of 8/32/64 heads, both layouts")
    p.add_argument("--dump", default=None, help="folder for sass.txt / ttgir.txt / ptx.txt of each build")
    p.add_argument("--json", action="store_true", help="one JSON object a line: config, sm, report or error")
    args = p.parse_args(argv)
    configs = [json.loads(c) for c in args.config] + (default_configs() if args.defaults else [])
    if not configs:
        p.error("give --config and/or --defaults")
    for i, cfg in enumerate(configs):
        try:
            compiled = build(cfg, args.sm)
        except Exception as exc:  # noqa: BLE001 (report every configuration)
            root = exc
            while root.__cause__ is not None:     # Triton wraps the reason in CompilationErrors per call level
                root = root.__cause__
            if args.json:
                print(json.dumps({"sm": args.sm, "config": cfg, "error": f"{type(root).__name__}: {root}"}))
            else:
                print(f"sm_{args.sm} {json.dumps(cfg)}: BUILD FAILED {type(root).__name__}: {str(root)[:300]}")
            continue
        rep = report(compiled)
        sass = rep.pop("_sass")
        print(json.dumps({"sm": args.sm, "config": cfg, "report": rep}) if args.json
              else f"sm_{args.sm} {json.dumps(cfg)}: {rep}")
        if args.dump:
            d = os.path.join(args.dump, f"config{i}")
            os.makedirs(d, exist_ok=True)
            for name, text in (("sass.txt", sass), ("ttgir.txt", compiled.asm["ttgir"]), ("ptx.txt", compiled.asm["ptx"])):
                with open(os.path.join(d, name), "w") as fh:
                    fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
