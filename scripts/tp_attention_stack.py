#!/usr/bin/env python3
"""Tensor-parallel GLM-5 attention-stack decode benchmark (issue 11).

    python scripts/tp_attention_stack.py --world-size 8 --backend nccl --out results/tp/   # nvidia-h200-x8
    python scripts/tp_attention_stack.py --world-size 1 --tp 8 --out results/tp/           # one TP8 slice, 1 GPU
    python scripts/tp_attention_stack.py --world-size 2 --backend gloo --profile cpu       # CPU, tiny widths

One process per GPU (torch.multiprocessing), NVLink multicast off in every process
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). See
glm5lab/bench/tensor_parallel.py for what is measured.
"""
import os
import sys

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v      # before torch/NCCL load, and inherited by the spawned workers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # repo root, uninstalled use

from glm5lab.bench.tensor_parallel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
