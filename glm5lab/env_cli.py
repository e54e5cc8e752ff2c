"""`glm5lab env`: versions, GPU and interpreter mode, as one table (or JSON)."""
from __future__ import annotations

import json


def _run(args) -> int:
    from glm5lab.env import collect, format_report, git_sha, gpu_info, gpu_slug

    if args.sha:
        print(git_sha() or "unrecorded")
        return 0
    if args.slug:
        print(gpu_slug(gpu_info()["gpu"]))
        return 0
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("env", help="print torch/triton/vllm/gguf versions, GPU and interpreter mode")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="print JSON instead of a table")
    what.add_argument("--slug", action="store_true",
                   help="print only the GPU model's file-name word (h200, h100, rtxpro6000; cpu without a GPU)")
    what.add_argument("--sha", action="store_true",
                      help="print only the commit results name: HEAD, with -dirty when the code differs from it")
    p.set_defaults(func=_run)
