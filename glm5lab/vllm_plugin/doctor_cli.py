"""`glm5lab doctor`: which MLA attention backend the installed vLLM would pick for a GPU and model.

Prints every backend's verdict with its reasons (static constraint / missing library on this machine /
could not be asked), then ONE line: the pick, or why none and what to change.
"""
from __future__ import annotations

import logging
import os


def _quiet_vllm() -> None:
    """vLLM logs at INFO on import; the doctor's output is the table."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)


def _run(args) -> int:
    from glm5lab.errors import Glm5labError
    from glm5lab.vllm_plugin import backend_doctor as bd

    sparse = None if args.sparse is None else args.sparse == "yes"
    if args.matrix:
        spanned = [flag for flag, value in (("--capability", args.capability), ("--dtype", args.dtype),
                                            ("--kv-cache-dtype", args.kv_cache_dtype), ("--all", args.all or None))
                   if value is not None]
        if spanned:
            raise Glm5labError(f"--matrix spans every capability x dtype x KV-cache dtype and lists the considered "
                               f"backends; drop {', '.join(spanned)}")
    capability, dtype = args.capability or "12.0", args.dtype or "bfloat16"
    # validate user input before the slow vLLM import, so a typo costs no time
    bd.parse_capability(capability)
    bd.parse_dtype(dtype)
    bd.load_model_config(args.model)
    _quiet_vllm()
    if args.matrix:
        from glm5lab.env import default_results_dir

        out = bd.write_matrix_results(args.results_dir or default_results_dir(), model=args.model,
                                      include_glm5lab=args.with_glm5lab,
                                      progress=True, sparse=sparse, block_size=args.block_size,
                                      tensor_parallel_size=args.tensor_parallel_size)
        print(out["cells"][["capability", "dtype", "kv_cache_dtype", "pick", "status"]].to_string(index=False))
        print(f"wrote {out['cells_csv']}, {out['long_csv']}, {out['png']}")
        return 0
    df = bd.diagnose(capability=capability, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype or "auto",
                     block_size=args.block_size, model=args.model, sparse=sparse,
                     tensor_parallel_size=args.tensor_parallel_size,
                     include_glm5lab=args.with_glm5lab, scope="all" if args.all else "considered")
    print(f"target: {df.attrs['target_text']}  (vLLM {df.attrs['vllm_version']})")
    if df.attrs.get("plugin_note"):
        print(f"note: {df.attrs['plugin_note']}")
    print(bd.format_table(df))
    print(bd.advice(df))
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("doctor", help="which MLA attention backend vLLM would pick for a GPU and model, "
                                      "or why none")
    p.add_argument("--capability", default=None, help="target compute capability, e.g. 8.0 9.0 10.0 12.0 "
                                                        "(default 12.0)")
    p.add_argument("--dtype", default=None, help="model dtype: float16 | bfloat16 (default bfloat16)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="vLLM KV-cache dtype: auto, fp8, fp8_ds_mla, ... (default auto)")
    p.add_argument("--block-size", type=int, default=None, help="KV-cache block size (default: vLLM picks)")
    p.add_argument("--model", default="glm-5",
                   help="tiny | glm-5 | deepseek-v3.2 | PATH (HF dir or .gguf; default glm-5)")
    p.add_argument("--sparse", choices=["yes", "no"], default=None,
                   help="force sparse MLA on/off (default: sparse iff the config has index_topk, as vLLM)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="heads per GPU = heads / TP")
    p.add_argument("--with-glm5lab", action="store_true",
                   help="vLLM with glm5lab's plugin on a CUDA host: TRITON_MLA_SPARSE registered, and last in "
                        "vLLM's own order")
    p.add_argument("--all", action="store_true", help="also list MLA backends vLLM does not consider here")
    p.add_argument("--matrix", action="store_true",
                   help="compute the capability x dtype x KV-dtype heat map and write it under --results-dir "
                        "(with --model, --sparse, --block-size, --tensor-parallel-size, --with-glm5lab)")
    p.add_argument("--results-dir", "--results", default=None,
                   help="where --matrix writes doctor/ (default: the checkout's results/, else ./results)")
    p.set_defaults(func=_run)
