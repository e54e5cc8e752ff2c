"""Time a kernel benchmark on PTX edited after Triton wrote it: what a change to one instruction's form costs, when
Gluon has no way to ask for that form (NOTES.md v33).

Two (or more) processes of the same command, each on a fresh (emptied) Triton cache: the first as built, with
Triton's IR dump on; then, for each edit, the dumped PTX of every kernel is edited and the command runs again with
Triton's kernel override pointing at the edited files (TRITON_KERNEL_OVERRIDE: the override's PTX replaces the PTX
stage, ptxas builds the cubin from it). An edit that changes no kernel, or an edited kernel that process did not
build from its edit, stops the script with the reason. The benchmark's own same-process reference (FlashMLA's
kernels in kernel_bench) is what makes the processes comparable.

    python3 scripts/ptx_variant.py --work /tmp/pv --edits l2_128 l2_256 -- \
        python3 -m glm5lab.bench.kernel_bench --out 'kb_{edit}.csv' --heads 8 --tokens 512 --no-variants --interleave 15

`{edit}` in the command becomes the edit's name ("base" for the build as it is). --offline FILE.ptx instead edits
one PTX file and prints what ptxas (Triton's, sm_90a) makes of each edit: registers, stack, instructions and the
LDGSTS by their predicate and form; no GPU needed. (NOTES.md v33 tried the dual consumers' e4m3 conversion in
integer operations as a Gluon option instead, `versions/alu_cvt_v33_rejected.patch.txt`.)"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

# `selp.b32 %rS, N, 0, %pM;` then the copy that takes %rS as its src-size (Triton's masked cp.async)
_SELP = re.compile(r"selp\.b32\s+(%r\d+),\s*(\d+),\s*0,\s*(%p\d+);")
_COPY = re.compile(r"(cp\.async\.c[ag]\.shared\.global)(\s*\[[^\]]*\],\s*\[[^\]]*\],\s*0x[0-9a-f]+),\s*(%r\d+);")


def ignore_src(ptx: str) -> str:
    """Each masked cp.async in PTX's ignore-src form: a predicate (the mask negated) in place of the src-size
    register that is 0 or the copy's size."""
    mask_of = {m.group(1): (m.group(3), int(m.group(2))) for m in _SELP.finditer(ptx)}
    count = 0

    def repl(m):
        nonlocal count
        if m.group(3) not in mask_of:
            return m.group(0)
        mask, size = mask_of[m.group(3)]
        if size != int(m.group(2).rsplit(",", 1)[1], 16):
            raise ValueError(f"ignore_src: a cp.async of {m.group(2).rsplit(',', 1)[1].strip()} bytes whose src-size "
                             f"selects {size}")
        count += 1
        z = f"%pzs{count}"
        return f"not.pred {z}, {mask};\n\t{m.group(1)}{m.group(2)}, {z};"

    out = _COPY.sub(repl, ptx)
    if not count:
        raise ValueError("ignore_src: no masked cp.async (selp + src-size register) in this PTX")
    return _declare(out, f"\t.reg .pred \t%pzs<{count + 1}>;")


def _declare(ptx: str, line: str) -> str:
    """Add a register declaration after the kernel's (the .entry's) first .reg line."""
    i = ptx.index(".reg", ptx.index(".entry"))
    j = ptx.index("\n", i)
    return ptx[:j + 1] + line + "\n" + ptx[j + 1:]


def _prefetch(size: int):
    def edit(ptx: str) -> str:
        out, n = re.subn(r"cp\.async\.cg\.shared\.global(?=\s)", f"cp.async.cg.shared.global.L2::{size}B", ptx)
        if not n:
            raise ValueError(f"l2_{size}: no cp.async.cg in this PTX")
        return out
    edit.__doc__ = f"The 16-byte cp.async copies with the L2 prefetch-size hint .L2::{size}B."
    return edit


EDITS = {"ignore_src": ignore_src, "l2_128": _prefetch(128), "l2_256": _prefetch(256)}


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def build_sass(ptx: str) -> tuple:
    """ptxas (sm_90a) on PTX text: cuobjdump's SASS listing and its resource usage (registers, stack) of the cubin."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-O3", src, "-o", cubin], check=True, capture_output=True)
        return tuple(subprocess.run([_tool("cuobjdump"), flag, cubin], check=True, capture_output=True,
                                    text=True).stdout for flag in ("-sass", "-res-usage"))


def copies_summary(ptx: str) -> dict:
    """ptxas (sm_90a) on PTX text: registers, stack, instructions and the LDGSTS by form and predicate operand."""
    sass, res = build_sass(ptx)
    preds = collections.Counter()
    for line in sass.splitlines():
        if "LDGSTS" in line and "ARRIVE" not in line:
            m = re.search(r"(LDGSTS\S*).*\],\s*(!?U?P\w+)\s*;", line)
            preds[f"{m.group(1)} {m.group(2)}" if m else "other"] += 1
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
                              for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass))
    return {"LDGSTS by form and predicate": dict(sorted(preds.items())),
            **dict(re.findall(r"(REG|STACK):(\d+)", res)[:2]), "instructions": sum(ops.values())}


def _run(cmd: list, edit: str, env: dict) -> int:
    argv = [a.replace("{edit}", edit) for a in cmd]
    print(f"[ptx_variant] {' '.join(argv)}", flush=True)
    return subprocess.run(argv, env=env).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--work", help="folder for the dump, the edited PTX and the Triton caches")
    p.add_argument("--edits", nargs="+", default=["l2_256"], choices=sorted(EDITS))
    p.add_argument("--offline", metavar="PTX", help="edit this PTX file and print each build's copies (no GPU)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to time")
    a = p.parse_args(argv)
    if a.offline:
        with open(a.offline) as f:
            ptx = f.read()
        print("as built:", copies_summary(ptx))
        for name in a.edits:
            print(f"{name}:", copies_summary(EDITS[name](ptx)))
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not a.work or not cmd:
        p.error("--work and a command after -- are needed (or --offline PTX)")
    os.makedirs(a.work, exist_ok=True)
    dump = os.path.join(a.work, "dump")
    shutil.rmtree(dump, ignore_errors=True)
    env = {**os.environ, "TRITON_KERNEL_DUMP": "1", "TRITON_DUMP_DIR": dump,
           "TRITON_CACHE_DIR": _fresh(os.path.join(a.work, "cache_base"))}
    rc = _run(cmd, "base", env)
    if rc:
        return rc
    ptx_files = [os.path.join(r, f) for r, _, fs in os.walk(dump) for f in fs if f.endswith(".ptx")]
    if not ptx_files:
        raise SystemExit(f"ptx_variant: the command built no Triton kernel (nothing dumped under {dump})")
    for name in a.edits:
        over = os.path.join(a.work, f"override_{name}")
        shutil.rmtree(over, ignore_errors=True)
        edited = 0
        for path in ptx_files:
            with open(path) as f:
                ptx = f.read()
            try:
                new = EDITS[name](ptx)
            except ValueError:
                continue          # (a kernel without such copies: built as it is)
            dst = os.path.join(over, os.path.relpath(path, dump))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "w") as f:
                f.write(new)
            edited += 1
        print(f"[ptx_variant] {name}: {edited} of {len(ptx_files)} kernels edited", flush=True)
        if not edited:
            raise SystemExit(f"ptx_variant: {name} changes none of the {len(ptx_files)} kernels the command built")
        cache = _fresh(os.path.join(a.work, f"cache_{name}"))
        env = {**os.environ, "TRITON_KERNEL_OVERRIDE": "1", "TRITON_OVERRIDE_DIR": over, "TRITON_CACHE_DIR": cache}
        rc = _run(cmd, name, env) or rc
        _check_overridden(over, cache, name)
    return rc


def _fresh(path: str) -> str:
    """An empty Triton cache folder: a cache hit would skip the compile, so neither the dump nor the override would
    happen (neither is in Triton's cache key)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _check_overridden(over: str, cache: str, name: str) -> None:
    """Every edited PTX is what Triton built from in the edit's process (the PTX its cache kept), or say which not."""
    built = {}
    for r, _, fs in os.walk(cache):
        for f in fs:
            if f.endswith(".ptx"):
                with open(os.path.join(r, f)) as fh:
                    built.setdefault(f, set()).add(fh.read())
    for r, _, fs in os.walk(over):
        for f in fs:
            with open(os.path.join(r, f)) as fh:
                if fh.read() not in built.get(f, set()):
                    raise SystemExit(f"ptx_variant: {name}: Triton did not build {f} from the edited PTX (no such "
                                     "kernel compiled in that process, or the override did not apply)")


if __name__ == "__main__":
    sys.exit(main())
