"""`glm5lab gguf {tiny,write,inspect,split,merge,estimate}`: the GGUF tools from the shell."""
from __future__ import annotations

import json
from pathlib import Path


def add_command(subparsers) -> None:
    p = subparsers.add_parser("gguf", help="GLM-5 GGUF tools: tiny model, HF->GGUF, inspect, split, merge, size estimate",
                              description="GGUF tools for GLM-5 (llama.cpp architecture glm-dsa).")
    sub = p.add_subparsers(dest="gguf_command", metavar="ACTION", required=True)

    t = sub.add_parser("tiny", help="generate (or reuse) the tiny GLM-5 HF checkpoint and GGUFs")
    t.add_argument("--root", type=Path, default=None, help="cache root (default: $GLM5LAB_CACHE or ~/.cache/glm5lab)")
    t.add_argument("--qtypes", default="F16,Q8_0", help="comma-separated GGUF types (F32,F16,BF16,Q8_0)")
    t.set_defaults(func=_tiny)

    w = sub.add_parser("write", help="convert an HF GLM-5 checkpoint directory to a glm-dsa GGUF")
    w.add_argument("hf_dir", type=Path)
    w.add_argument("out", type=Path)
    w.add_argument("--qtype", default="F16", help="F32, F16, BF16 or Q8_0 (default F16)")
    w.add_argument("--shards", type=int, default=1, help="write N split shards <stem>-0000k-of-0000N.gguf")
    w.set_defaults(func=_write)

    i = sub.add_parser("inspect", help="header, metadata, tensor table and HF config of a GGUF / shard set")
    i.add_argument("path", type=Path, nargs="+", help="a GGUF file, any shard of a set, or all shards")
    i.add_argument("--tensors", action="store_true", help="print the full tensor table")
    i.add_argument("--metadata", action="store_true", help="print every metadata key (arrays summarized)")
    i.add_argument("--json", action="store_true", help="machine-readable summary")
    i.set_defaults(func=_inspect)

    s = sub.add_parser("split", help="split one GGUF into N llama.cpp-style shards")
    s.add_argument("path", type=Path)
    s.add_argument("n", type=int)
    s.add_argument("--out", default=None,
                   help="base name for the shards, or a folder to put them in (an existing one, or a path ending "
                        "in /; default: beside the input, named after it)")
    s.set_defaults(func=_split)

    m = sub.add_parser("merge", help="validate a shard set and merge it into one GGUF")
    m.add_argument("shards", type=Path, nargs="+", help="any shard of the set, or all of them")
    m.add_argument("out", type=Path)
    m.set_defaults(func=_merge)

    e = sub.add_parser("estimate", help="ESTIMATED size of the real GLM-5 GGUF per component/type")
    e.add_argument("--qtypes", default="Q4_K,Q8_0")
    e.set_defaults(func=_estimate)


def _tiny(args) -> int:
    from glm5lab.model.tiny import ensure_tiny

    qtypes = tuple(q.strip().upper() for q in args.qtypes.split(",") if q.strip())
    paths = ensure_tiny(args.root, qtypes=qtypes)
    print(f"hf_dir: {paths.hf_dir}")
    for q in qtypes:
        print(f"{q}: {paths.gguf(q)}")
    return 0


def _write(args) -> int:
    from glm5lab.gguf.writer import convert_hf_to_gguf

    for p in convert_hf_to_gguf(args.hf_dir, args.out, qtype=args.qtype, n_shards=args.shards):
        print(p)
    return 0


def _shard_arg(paths: list[Path]):
    return paths[0] if len(paths) == 1 else paths


def _inspect(args) -> int:
    import pandas as pd

    from glm5lab.gguf.inspect import inspect_gguf

    r = inspect_gguf(_shard_arg(args.path))
    if args.json:
        out = dict(header=r.header, hyperparams=r.hyperparams,
                   by_component=r.by_component["bytes"].to_dict(), by_type=r.by_type["bytes"].to_dict())
        if args.metadata:
            out["metadata"] = r.metadata.to_dict(orient="records")
        if args.tensors:
            out["tensors"] = r.tensors.astype({"layer": object}).to_dict(orient="records")
        print(json.dumps(out, indent=2, default=str))
        return 0
    with pd.option_context("display.width", 160, "display.max_rows", 10000, "display.max_colwidth", 80):
        print("== header"); [print(f"  {k}: {v}") for k, v in r.header.items()]
        print("== MLA / DSA hyperparameters"); [print(f"  {k}: {v}") for k, v in r.hyperparams.items()]
        if args.metadata:
            print("== metadata"); print(r.metadata.to_string(index=False))
        print("== bytes by component"); print(r.by_component.to_string())
        print("== bytes by type"); print(r.by_type.to_string())
        if args.tensors:
            print("== tensors"); print(r.tensors.to_string(index=False))
    return 0


def _split(args) -> int:
    from glm5lab.gguf.shards import split_gguf

    for p in split_gguf(args.path, args.n, args.out):
        print(p)
    return 0


def _merge(args) -> int:
    from glm5lab.gguf.shards import merge_shards

    print(merge_shards(_shard_arg(args.shards), args.out))
    return 0


def _estimate(args) -> int:
    from glm5lab.gguf.inspect import estimate_real_glm5

    df = estimate_real_glm5(tuple(q.strip() for q in args.qtypes.split(",")))
    print("ESTIMATE from GlmMoeDsaConfig() defaults (78 layers + 1 MTP block, 256 experts, vocab 154880):")
    print(df.drop(columns=["label"]).to_string(index=False))
    print(df.groupby("qtype")["GB"].sum().rename("total GB").to_string())
    return 0
