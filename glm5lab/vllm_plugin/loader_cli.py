"""`glm5lab loader check GGUF [--hf-dir DIR]`: does this GLM-5 GGUF load into vLLM, and correctly?

Runs the installed plugin's GGUF reader + glm5lab's adapter (every tensor vs the HF checkpoint when --hf-dir
is given), then vLLM's own GlmMoeDsaForCausalLM on CPU through vLLM's GGUF loader (missing / refused names,
values of every parameter it can read back). Exit 0 when everything matches, 1 otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path

from glm5lab.cli import stdout_to_stderr
from glm5lab.errors import Glm5labError, first_line


def _check(args) -> int:
    from glm5lab.gguf.reader import open_gguf

    gguf_path = Path(args.gguf)
    if not gguf_path.exists():
        raise Glm5labError(f"{gguf_path}: no such file")
    hf_dir = Path(args.hf_dir) if args.hf_dir else None
    if hf_dir is not None and not (hf_dir / "config.json").exists():
        raise Glm5labError(f"{hf_dir}: not an HF checkpoint (no config.json)")
    s = open_gguf(gguf_path)  # one-line errors for bad / non-glm-dsa / incomplete shard sets
    if hf_dir is not None or not args.no_vllm:   # these read tensors back: types they cannot read end it here
        from glm5lab.gguf.reader import require_readable_types

        require_readable_types(s)

    from glm5lab.vllm_plugin.loader_check import adapter_names_report, adapter_report, vllm_load_report

    result: dict = {"gguf": str(gguf_path), "hf_dir": str(hf_dir) if hf_dir else None}
    ok = True
    if hf_dir is None:
        names = adapter_names_report(gguf_path)
        result["names"] = names
        ok &= not names["missing"] and not names["wrong_shape"] and not names["beyond_blocks"]
    else:
        df = adapter_report(gguf_path, hf_dir)
        bad = df[~df["ok"]]
        result["adapter"] = {
            "tensors": int(df["delivered"].sum()),
            "missing (in checkpoint, not delivered)": df[~df["delivered"]]["hf_name"].tolist(),
            "unexpected (delivered, not in checkpoint)": df[~df["in_checkpoint"]]["hf_name"].tolist(),
            "max_abs_err": float(df["max_abs_err"].max()),
            "max_err_over_bound": float(df["max_err_over_bound"].max()),
            "failing": bad["hf_name"].tolist()[:20],
        }
        ok &= bad.empty
    if not args.no_vllm:
        with stdout_to_stderr(args.json):
            try:
                rep = vllm_load_report(gguf_path, hf_dir, dtype=args.dtype)
            except Glm5labError:
                raise
            except Exception as exc:  # noqa: BLE001 -- vLLM refusing to build the model is this check's answer
                rep = {"refused": first_line(exc, 300), "missing": None, "built": False}
        result["vllm"] = rep
        ok &= rep["refused"] is None and not rep["missing"] and rep.get("values_ok", True)
    result["ok"] = bool(ok)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        _print(result)
    return 0 if ok else 1


def _print(result: dict) -> None:
    print(f"GGUF: {result['gguf']}")
    n = result.get("names")
    if n:
        print(f"adapter names: {n['mapped']} of {n['tensors']} tensors mapped to GLM-5 names, {len(n['skipped'])} "
              f"skipped by design; against the metadata: {len(n['missing'])} missing, {len(n['wrong_shape'])} "
              f"with another shape (no --hf-dir: values not compared)")
        for name in n["missing"][:20]:
            print(f"  MISSING {name}")
        for name, why in list(n["wrong_shape"].items())[:20]:
            print(f"  SHAPE {name}: {why}")
        for name in n["beyond_blocks"][:20]:
            print(f"  PAST block_count {name}")
    a = result.get("adapter")
    if a:
        print(f"adapter: {a['tensors']} tensors; missing {len(a['missing (in checkpoint, not delivered)'])}, "
              f"unexpected {len(a['unexpected (delivered, not in checkpoint)'])}; max |err| {a['max_abs_err']:.3g} "
              f"= {a['max_err_over_bound']:.3f} x the file type's bound")
        for name in a["failing"]:
            print(f"  FAIL {name}")
    v = result.get("vllm")
    if v and v.get("built") is False:
        print(f"vLLM could not build the model from it: {v['refused']}")
    elif v:
        print(f"vLLM {v['model_class'].rsplit('.', 1)[-1]} ({v['dtype']}, config from {v['config_from']}, "
              f"adapter {v['adapter']}): {v['n_params']} parameters, {v['n_quantized_params']} GGUF-quantized")
        if v["refused"]:
            print(f"  refused: {v['refused']}")
        else:
            print(f"  missing after load_weights: {v['missing'] or 'none'}")
        if "max_rel_err" in v:
            print(f"  values: {v['params_compared']} parameters compared, max |err|/max|ref| {v['max_rel_err']:.3g} "
                  f"(allowed {v['allowed_rel_err']:.3g}, worst {v['worst_param']})")
    print("OK" if result["ok"] else "FAILED")


def add_command(sub) -> None:
    p = sub.add_parser("loader", help="GLM-5 GGUF loading into vLLM (vllm-gguf-plugin + glm5lab's fixes)")
    lsub = p.add_subparsers(dest="loader_command", metavar="ACTION", required=True)
    c = lsub.add_parser("check", help="load a glm-dsa GGUF through the plugin + glm5lab's adapter and vLLM's "
                                      "GLM-5 model on CPU; compare with the HF checkpoint")
    c.add_argument("gguf", help="GGUF file (or the first shard of a split set)")
    c.add_argument("--hf-dir", help="HF checkpoint (config.json + safetensors) to compare against; without it "
                                    "the config comes from the GGUF metadata and values are not compared")
    c.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"],
                   help="vLLM model dtype (default bfloat16, see glm5lab.vllm_plugin.gguf_loader)")
    c.add_argument("--no-vllm", action="store_true", help="only the adapter-level check (fast, no vLLM model): "
                                                          "values against --hf-dir, or without it the names and "
                                                          "shapes against the GGUF's own metadata")
    c.add_argument("--json", action="store_true", help="print the full report as JSON")
    c.set_defaults(func=_check)
