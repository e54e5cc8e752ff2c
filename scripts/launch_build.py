"""Every Triton launch glm5lab's host functions make, built for a GPU on this CPU machine; no launch runs.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler refuses (a loop-carried
variable re-bound at another shape, say). Twice a kernel passed every CPU test and then failed to compile on the
device (NOTES.md v51 call 8, v52 call 3: the split top-k's write kernel built only at 1024-column blocks). This
script calls the host functions with CPU tensors and the options a GPU run takes (blocks, tiles, warps, fp8 decode),
catches each launch before it would run, and builds it for sm_<N> with Triton's bundled ptxas (as
scripts/sass_report.py does). One line a distinct build: kernel, constexprs, warps, registers, stack bytes (spills),
shared memory, or the compiler's error. A build needing more shared memory than the target gives a block raises
OutOfResources at its launch, as on the device, so a host's fallbacks run here too; a host call that raises is a row.
Exit status 1 when a build fails, a host call raises or a kernel of a driven module was never launched.

    PYTHONPATH=. python scripts/launch_build.py --sm 90 120            # every case, a table
    PYTHONPATH=. python scripts/launch_build.py --case indexer_topk --json
    PYTHONPATH=. python scripts/launch_build.py --sm 90 120 100 86 --csv results/kernels/offline_builds.csv
    PYTHONPATH=. python scripts/launch_build.py --cases-from my_cases.py   # its CASES {name: fn(sm)}, MODULES

Run it as a script: it turns the interpreter off for its own process before any kernel module is imported.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)   # a real build, even when the shell has the interpreter on
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from sass_report import resource_usage  # noqa: E402
from glm5lab.cli import first_paragraph  # noqa: E402
from glm5lab.kernels.host import SHARED_MEMORY_PER_BLOCK, shared_memory_per_block  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402


def plain(value):
    """A constexpr's Python value (Triton wraps some in tl.constexpr)."""
    return getattr(value, "value", value)


@contextlib.contextmanager
def launches_built_for(sm: int, builds: dict):
    """Inside: `kernel[grid](...)` builds the kernel for sm_<sm> and returns None instead of launching it. `builds`
    gets one entry a distinct (kernel, constexprs, options): its resources or its error. A build that needs more
    shared memory than sm_<sm> gives a block raises OutOfResources, as its launch would on the device, so host code
    that falls back to a smaller pipeline does so here too. Outputs stay unwritten, so host code between launches
    sees uninitialised memory (fine for host code that only reads shapes)."""
    smem_limit = shared_memory_per_block(divmod(sm, 10))     # what a launch is checked against on the device
    if smem_limit is None:
        known = sorted(major * 10 + minor for major, minor in SHARED_MEMORY_PER_BLOCK)
        raise SystemExit(f"sm_{sm}: no shared-memory limit known (known: {known})")
    target = GPUTarget("cuda", sm, 32)
    backend = make_backend(target)
    original = JITFunction.run
    binders = {}     # a kernel's argument binder, made once (as Triton's own run does, per device)

    def build(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        if self not in binders:
            binders[self] = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        names = list(self.arg_names)
        consts = {names[path[0]]: plain(value) for path, value in constexprs.items() if len(path) == 1}
        key = (sm, self.fn.__name__, json.dumps(consts, sort_keys=True, default=str), options.num_warps,
               options.num_stages)
        if key not in builds:
            builds[key] = _build(self, signature, constexprs, attrs, options, consts)
        if builds[key].get("over_smem_limit"):
            raise OutOfResources(builds[key]["smem"], smem_limit, "shared memory")
        return None

    def _build(self, signature, constexprs, attrs, options, consts):
        entry = {"sm": sm, "module": self.fn.__module__, "kernel": self.fn.__name__, "constexprs": consts,
                 "num_warps": options.num_warps, "num_stages": options.num_stages}
        start = time.perf_counter()
        try:
            source = GluonASTSource if self.is_gluon() else ASTSource
            compiled = triton_compile(source(self, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            entry.update(resource_usage(compiled.asm["cubin"]), smem=compiled.metadata.shared,
                         over_smem_limit=compiled.metadata.shared > smem_limit)
            if re.search(r"^\s*trap;", compiled.asm["ptx"], re.M):
                # glm5lab's kernels assert nothing on the device: a trap is the compiler giving up on the kernel
                entry["error"] = ("compiled to a trap: the PTX holds `trap;` (Triton lowers a kernel it cannot "
                                  "place, e.g. tensor memory beyond the SM's, to a trap), so every launch would fault")
        except Exception as err:   # the compiler's own message is the result
            entry["error"] = f"{type(err).__name__}: {err}"[-1500:]
        entry["build_s"] = round(time.perf_counter() - start, 2)
        return entry

    from glm5lab.kernels import checks

    JITFunction.run = build
    checks.LAUNCHES_INTERCEPTED = True      # the host functions' CPU tensors are built for, never launched
    try:
        yield builds
    finally:
        JITFunction.run = original
        checks.LAUNCHES_INTERCEPTED = False


# ------------------------------------------------------------------------------------------------- the cases
REFUSALS: list = []     # host calls that raised, as rows (a case goes on to its next call)


def attempt(sm: int, what: str, fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs); an exception becomes a row of REFUSALS naming the call."""
    try:
        fn(*args, **kwargs)
    except Exception as err:
        REFUSALS.append({"sm": sm, "case": what, "host_error": f"{type(err).__name__}: {err}"})


def indexer_topk(sm: int):
    """The three top-k methods at the blocks the op picks on a GPU (split_block's 512 and 1024, the GPU test's 256),
    a register-held row and a streamed one, k below, at and above a block of k."""
    from glm5lab.kernels import dsa_indexer as d

    torch.manual_seed(0)
    for columns, rows in ((3001, 2), (4096, 1), (16384, 1), (65536, 1), (16384, 64)):
        x = torch.randn(rows, columns)
        for k in (100, 2048):
            d.indexer_topk(x, k, method="split")
            d.indexer_topk(x, k, method="hist")
        d.indexer_topk(x, 2048, method="radix16")
    d.indexer_topk(torch.randn(3, 5000), 2048, method="split", block=256)


def indexer_logits(sm: int):
    """Decode logits on a plain (fp16 / bf16 / fp32) and an fp8 index-key cache at the tilings a GPU run takes
    (64 and 128 keys a tile, 4 and 8 warps, pipelined tiles, both dot orders, fp8 keys' sum over D in both
    orders of D, an e4m3 q; fp8 keys by the hardware conversion from
    SM89 on and by the integer decode, which GPUs before SM89 take, with the dot in fp16 and in q's dtype), and the
    prefill logits (plain keys; fp8 keys with a bf16 and an e4m3 q, one key tile a program and eight, both dot
    orders, a 256-row q tile on 8 warps)."""
    from glm5lab.kernels import dsa_indexer as d

    torch.manual_seed(0)
    T, H, D, page, blocks = 3, 32, 128, 64, 8
    table = torch.arange(T * blocks, dtype=torch.int32).reshape(T, blocks)
    lens = torch.tensor([500, 17, 64 * blocks], dtype=torch.int32)
    w = torch.randn(T, H)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q = torch.randn(T, H, D, dtype=dtype)
        plain_keys = torch.randn(T * blocks, page, D, dtype=dtype)
        for block_n, warps in ((64, 4), (128, 4), (128, 8)):
            for keys_as_m in (False, True):
                d.indexer_logits_decode(q, w, plain_keys, table, lens, block_n=block_n, num_warps=warps,
                                        keys_as_m=keys_as_m)
        d.indexer_logits_prefill(q, w, torch.randn(600, D, dtype=dtype), torch.zeros(T, dtype=torch.int32),
                                 lens.clamp(max=600))
    fp8 = torch.zeros(T * blocks, page, D + 4, dtype=torch.uint8)
    d.write_index_key_cache(fp8, torch.randn(T * blocks * page, D), torch.arange(T * blocks * page))
    q = torch.randn(T, H, D, dtype=torch.bfloat16)
    for block_n in (64, 128):
        for soft in (True,) if sm < 89 else (False, True):
            for keys_as_m in (False, True):
                for permute_d in (False, True):
                    d.indexer_logits_decode(q, w, fp8, table, lens, block_n=block_n, soft_fp8=soft,
                                            keys_as_m=keys_as_m, permute_d=permute_d)
                    d.indexer_logits_decode(q, w, fp8, table, lens, block_n=block_n, soft_fp8=soft, f16_dot=False,
                                            keys_as_m=keys_as_m, permute_d=permute_d)
            for keys_as_m in (False, True):
                d.indexer_logits_decode(q, w, fp8, table, lens, block_n=block_n, soft_fp8=soft, tiles=4, num_stages=3,
                                        keys_as_m=keys_as_m)
                # an e4m3 q (vLLM's): the fp8 x fp8 dot from SM89 on, widened to bf16 before
                d.indexer_logits_decode(q.to(torch.float8_e4m3fn), w, fp8, table, lens, block_n=block_n,
                                        soft_fp8=soft, keys_as_m=keys_as_m)
    # the prefill logits on fp8 keys as vLLM gathers them (e4m3, a scale a key): a bf16 and an e4m3 q, the hardware
    # conversion from SM89 on and the integer decode
    # (8 tokens: room for a 256-row q tile), both dot orders, 4 and 8 warps
    pair = d.quantize_keys_fp8(torch.randn(600, D))
    q8t, w8t = torch.randn(8, H, D, dtype=torch.bfloat16), torch.randn(8, H)
    ks8, ke8 = torch.zeros(8, dtype=torch.int32), torch.arange(593, 601, dtype=torch.int32)
    for soft in (True,) if sm < 89 else (False, True):
        for q_in in (q8t, q8t.to(torch.float8_e4m3fn)):
            for keys_as_m in (False, True):
                for tiling in ({"tiles": 1}, {"tiles": 8}, {"tiles": 16, "num_stages": 3},
                               {"block_m": 8, "block_n": 128, "num_warps": 8}):
                    d.indexer_logits_prefill(q_in, w8t, pair, ks8, ke8, soft_fp8=soft, keys_as_m=keys_as_m, **tiling)


def paged_decode(sm: int):
    """The paged dense MLA decode (the virtual-block-table path) at the GPU's tile (16 heads, 32 keys), one split
    and several."""
    from glm5lab.kernels.paged_mla_decode import paged_mla_decode

    torch.manual_seed(0)
    rows, heads, page, blocks = 2, 16, 64, 4
    table = torch.arange(rows * blocks, dtype=torch.int32).reshape(rows, blocks)
    lens = torch.tensor([200, 64 * blocks], dtype=torch.int32)
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(rows, heads, 576, dtype=dtype)
        kv = torch.randn(rows * blocks, page, 576, dtype=dtype)
        for splits in (1, 4):
            paged_mla_decode(q, kv, table, lens, 576 ** -0.5, num_splits=splits, block_h=16, block_n=32)


@contextlib.contextmanager
def sparse_mla_sees(sm: int, sms: int = 132):
    """sparse_mla's host asks the device its compute capability and SM count (fp8 conversion, PDL, splits); here it
    is told sm_<sm> with `sms` SMs, so its choices are that GPU's."""
    from glm5lab.kernels import sparse_mla

    told = divmod(sm, 10)
    saved = {n: getattr(sparse_mla, n) for n in ("_nvidia_sm_at_least", "cuda_capability", "sm_count")}
    sparse_mla._nvidia_sm_at_least = lambda device, capability: told >= tuple(capability)
    sparse_mla.cuda_capability = lambda device: told
    sparse_mla.sm_count = lambda device: sms
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(sparse_mla, n, f)


def sparse_mla(sm: int):
    """The portable Triton sparse-MLA kernel (the one Blackwell and every non-Hopper GPU runs) at its default tile
    for 8 / 16 / 32 / 64 / 128 heads, bf16 / fp16 / fp8_ds_mla caches, one split and several, both merges (fused;
    separate: unrolled up to 16 splits, by columns beyond). The Hopper-only Gluon kernels: sparse_mla_hopper."""
    from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla
    from glm5lab.kernels.sparse_mla import default_config_for, sparse_mla_attention

    torch.manual_seed(0)
    T, topk, blocks, page = 3, 2048, 40, 64
    slots = torch.randint(-1, blocks * page + 5, (T, topk), dtype=torch.int32)     # -1 and past the cache too
    with sparse_mla_sees(sm):
        for dtype in (torch.bfloat16, torch.float16):
            kv = torch.randn(blocks, page, 576, dtype=dtype)
            fp8 = quantize_fp8_ds_mla(kv.float())
            for heads in (8, 16, 32, 64, 128):
                q = torch.randn(T, heads, 576, dtype=dtype)
                for cache, is_fp8 in ((kv, False), (fp8, True)):
                    cfg = {**default_config_for(heads, is_fp8, divmod(sm, 10)), "impl": "triton"}
                    for splits, merge in ((1, "auto"), (2, "fused"), (2, "separate"), (32, "separate")):
                        what = (f"sparse_mla {heads} heads {'fp8_ds_mla' if is_fp8 else 'plain'} {dtype} "
                                f"{splits} splits {merge}")
                        attempt(sm, what, sparse_mla_attention, q, cache, slots, 576 ** -0.5, num_splits=splits,
                                merge=merge, _config=cfg)


def sparse_mla_hopper(sm: int):
    """On sm_90 only: sparse_mla_attention as an H100 / H200 runs it by default, so its Hopper Gluon kernels (rows-as-M
    kernels at 1-16 tokens, the dual and paired fp8 tiles, the 64-head warp-specialized and converter kernels) and
    their merges, by head count (8 / 16 / 64 / 128), batch (1 / 8 / 64 / 300 tokens: past one wave of 132 SMs) and
    layout (bf16, fp8_ds_mla). Their other variants (private _config) are built by scripts/sass_report.py's tests."""
    if sm != 90:
        return
    from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla
    from glm5lab.kernels.sparse_mla import sparse_mla_attention

    torch.manual_seed(0)
    topk, blocks, page = 2048, 40, 64
    kv = torch.randn(blocks, page, 576, dtype=torch.bfloat16)
    fp8 = quantize_fp8_ds_mla(kv.float())
    with sparse_mla_sees(sm):
        for tokens in (1, 8, 64, 300):
            slots = torch.randint(-1, blocks * page, (tokens, topk), dtype=torch.int32)
            for heads in (8, 16, 64, 128):
                q = torch.randn(tokens, heads, 576, dtype=torch.bfloat16)
                for cache, layout in ((kv, "bf16"), (fp8, "fp8_ds_mla")):
                    attempt(sm, f"sparse_mla (Hopper default) {tokens} tokens {heads} heads {layout}",
                            sparse_mla_attention, q, cache, slots, 576 ** -0.5)


CASES = {"indexer_topk": indexer_topk, "indexer_logits": indexer_logits, "paged_decode": paged_decode,
         "sparse_mla": sparse_mla, "sparse_mla_hopper": sparse_mla_hopper}
# the modules whose every *_kernel the cases must launch (a kernel left out would be a kernel never built)
MODULES = {"indexer_topk": "glm5lab.kernels.dsa_indexer", "indexer_logits": "glm5lab.kernels.dsa_indexer",
           "paged_decode": "glm5lab.kernels.paged_mla_decode", "sparse_mla": "glm5lab.kernels.sparse_mla"}


def never_launched(modules: set, builds: list) -> list:
    """Kernels (module-level JIT functions named *_kernel) of these modules that no case built."""
    built = {(b["module"], b["kernel"]) for b in builds if "kernel" in b}
    out = []
    for name in sorted(modules):
        mod = importlib.import_module(name)
        out += [f"{name}.{attr}" for attr, obj in vars(mod).items()
                if isinstance(obj, JITFunction) and attr.endswith("_kernel") and (name, attr) not in built]
    return out


def load_cases(path: str) -> tuple[dict, dict]:
    """CASES and MODULES of a Python file (its kernels imported after the interpreter was turned off)."""
    sys.modules.setdefault("launch_build", sys.modules[__name__])   # its `import launch_build` is this run
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES, getattr(mod, "MODULES", {})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=first_paragraph(__doc__))
    ap.add_argument("--sm", type=int, nargs="+", default=[90], help="compute capabilities to build for")
    ap.add_argument("--case", nargs="+", help=f"cases to run (default all: {', '.join(CASES)})")
    ap.add_argument("--cases-from", help="a Python file with CASES {name: fn(sm)} (and MODULES {name: module})")
    ap.add_argument("--json", action="store_true", help="one JSON object a line")
    ap.add_argument("--csv", help="append the builds' registers / stack / shared memory as long-format rows "
                                  "(glm5lab.bench.records, with provenance) to this CSV; only when every build passed")
    args = ap.parse_args(argv)
    cases, modules = load_cases(args.cases_from) if args.cases_from else (CASES, MODULES)
    unknown = set(args.case or ()) - set(cases)
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; known: {sorted(cases)}")
    chosen = args.case or list(cases)
    builds: dict = {}
    for sm in args.sm:
        for name in chosen:
            with launches_built_for(sm, builds):
                attempt(sm, name, cases[name], sm)   # a case that raises (a host refusal) is a row too
    rows = list(builds.values()) + REFUSALS
    # a module's kernels are all expected only when every case that drives it ran
    complete = {m for m in modules.values() if all(c in chosen for c, mod in modules.items() if mod == m)}
    missing = never_launched(complete, rows)
    failed = [r for r in rows if "error" in r or "host_error" in r]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"summary": True, "builds": len(rows), "failed": len(failed), "never_launched": missing}))
    else:
        for r in rows:
            if "host_error" in r:
                print(f"sm_{r['sm']} case {r['case']}: the host refused: {r['host_error']}")
                continue
            consts = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
            what = (f"ERROR {r['error'].splitlines()[-1][:200]}" if "error" in r
                    else f"regs {r['regs']:3d} stack {r['stack']:5d} smem {r['smem']:6d}"
                    + (" > the SM's limit" if r["over_smem_limit"] else ""))
            print(f"sm_{r['sm']} {r['kernel']:<28} w{r['num_warps']} s{r['num_stages']}  {what}  {consts}")
        print(f"{len(rows)} builds, {len(failed)} failed" + (f"; never launched: {missing}" if missing else ""))
    if args.csv and not failed and not missing:
        from glm5lab.bench import records

        n = records.append_rows(args.csv, csv_rows(rows), command="python scripts/launch_build.py "
                                + " ".join(argv if argv is not None else sys.argv[1:]))
        print(f"{n} rows appended to {args.csv}", file=sys.stderr)
    return 1 if failed or missing else 0


def csv_rows(rows: list) -> list:
    """Long-format rows: suite offline_build, implementation = kernel, shape = its constexprs and warps / stages,
    layout = the target (sm_<N>), metrics regs / stack_bytes / shared_bytes."""
    out = []
    for r in rows:
        shape = " ".join([f"{k}={v}" for k, v in r["constexprs"].items()] + [f"warps={r['num_warps']}",
                                                                              f"stages={r['num_stages']}"])
        for metric, key, unit in (("regs", "regs", "registers/thread"), ("stack_bytes", "stack", "B"),
                                  ("shared_bytes", "smem", "B")):
            out.append({"suite": "offline_build", "implementation": r["kernel"], "shape": shape, "dtype": "",
                        "layout": f"sm_{r['sm']}", "metric": metric, "value": r[key], "unit": unit})
    return out


if __name__ == "__main__":
    sys.exit(main())
