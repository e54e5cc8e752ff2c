"""One sparse-MLA call shape, launched a few times, for a profiler (ncu) to attach to: the same inputs as
glm5lab.bench.kernel_bench (524,288-slot fp8_ds_mla / bf16 cache, top-k 2048, random slots, bf16 q).

    ncu --section WarpStateStats --section SchedulerStats -k regex:sparse_mla python3 scripts/profile_one.py \
        --heads 8 --tokens 512 --layout fp8_ds_mla --config '{"impl": "gluon"}'
"""
import argparse
import json

import torch

from glm5lab.cli import first_paragraph
from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla
from glm5lab.kernels.sparse_mla import sparse_mla_attention
from glm5lab.sparse.reference import mla_softmax_scale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--slots", type=int, default=524288)
    p.add_argument("--layout", default="fp8_ds_mla", choices=("fp8_ds_mla", "bf16"))
    p.add_argument("--config", default="{}", help="JSON _config for sparse_mla_attention")
    p.add_argument("--variant", default="", help="a name from kernel_bench.GLUON_VARIANTS (its tile, impl gluon; "
                   "--config's keys over it)")
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_one.py needs a CUDA GPU: it is a target for a profiler (ncu)")
    config = json.loads(a.config) or None
    if a.variant:
        from glm5lab.bench.kernel_bench import GLUON_VARIANTS
        variants = dict(GLUON_VARIANTS)
        if a.variant not in variants:
            raise SystemExit(f"unknown variant {a.variant!r}; expected one of {list(variants)}")
        config = {**variants[a.variant], **(config or {}), "impl": "gluon"}   # (--config overrides the variant's keys)
    g = torch.Generator(device="cuda").manual_seed(1234)
    kv = torch.randn(a.slots // 64, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
    cache = quantize_fp8_ds_mla(kv) if a.layout == "fp8_ds_mla" else kv
    q = torch.randn(a.tokens, a.heads, 576, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randint(0, a.slots, (a.tokens, a.topk), device="cuda", dtype=torch.int32, generator=g)
    for _ in range(a.calls):
        sparse_mla_attention(q, cache, slots, mla_softmax_scale(), _config=config)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
