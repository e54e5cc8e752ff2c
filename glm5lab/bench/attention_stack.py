"""Decode steps of a GLM-5-shaped attention layer at the real widths, with random weights.

Why: kernel microbenchmarks say how fast attention is; serving cares what fraction of a decode step it
is. One layer's decode step, as a serving engine runs it for a batch of B requests each with a context
of L tokens (TP slice of H query heads; the indexer and the latent projections are replicated per GPU,
as vLLM does):

  x [B, 6144] -> RMSNorm -> q_a (6144->2048) -> RMSNorm -> q_b (2048 -> H*256)
              -> kv_a (6144 -> 576) -> RMSNorm(512) | rope(64) -> write one 576-wide latent row per request
  absorb      q_nope [B,H,192] x W_uk [H,192,512] -> q [B,H,576]
  indexer     q_i = q_a x (2048 -> 32*128), k_i = LN(x (6144->128)) -> index-key cache, w = x (6144->32)
              logits over the L context keys -> top-2048 -> global slots
  attention   sparse MLA over the 2048 selected latent rows        <- the part the implementations swap
  output      latent [B,H,512] x W_uv [H,512,256] -> o_proj (H*256 -> 6144)

Implementations: "glm5lab" (glm5lab's Triton indexer + fused sparse kernel), "flashmla" (glm5lab's indexer
+ FlashMLA's bf16 sparse kernel, heads padded to 64, when the anchor library is present), "torch"
(torch indexer + torch.topk + gather attention). Rows per shape: step time, attention time, indexer
time, attention share, per-layer tokens/s and the 78-layer attention-stack tokens/s (attention layers
only: MoE/MLP, embeddings and the LM head are not in it).

The step runs in eager PyTorch (about 30 launches, no CUDA graph): at batch 1 launch overhead is part of
the step time, as it would be in an engine without graphs; `attention_time` and `indexer_time` are each
timed alone, so their shares are not inflated by it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUITE = "attention_stack"
GLM5_LAYERS = 78


@dataclass(frozen=True)
class StackShape:
    hidden: int = 6144
    heads: int = 64
    q_lora: int = 2048
    kv_lora: int = 512
    rope: int = 64
    nope: int = 192
    v_head: int = 256
    index_heads: int = 32
    index_dim: int = 128
    topk: int = 2048
    page: int = 64


@dataclass(frozen=True)
class StackProfile:
    shape_kw: dict
    shapes: tuple          # (heads, batch, context) in priority order: the time budget cuts the tail
    impls: tuple
    cpu_reps: int = 1


_GPU_SHAPES = (
    # TP8 slice (8 heads) across batch at 4k, then long context, then one GPU's 64 heads, then TP4 (16)
    (8, 1, 4096), (8, 32, 4096), (8, 128, 4096), (8, 256, 4096),
    (8, 1, 65536), (8, 32, 65536), (8, 128, 65536),
    (64, 1, 4096), (64, 32, 4096), (64, 128, 4096), (64, 32, 65536),
    (8, 32, 16384), (16, 32, 4096), (16, 128, 4096), (8, 8, 4096), (8, 256, 16384),
    (64, 256, 4096), (16, 32, 65536), (64, 128, 16384), (8, 256, 65536),
)

PROFILES = {
    "gpu": StackProfile({}, _GPU_SHAPES, ("glm5lab", "flashmla", "torch")),
    "cpu": StackProfile(dict(hidden=256, q_lora=128, index_heads=4, topk=32, page=16), ((4, 1, 48), (4, 2, 48)),
                        ("glm5lab", "torch")),
}


class AttentionLayer:
    """Random-weight GLM-5 attention layer (bf16) plus the caches of B requests with L tokens each."""

    def __init__(self, s: StackShape, heads: int, batch: int, context: int, device: str, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        dt = torch.bfloat16
        self.s, self.H, self.B, self.L = s, heads, batch, context

        def w(out_f, in_f):
            return (torch.randn(out_f, in_f, device=device, generator=g) * in_f ** -0.5).to(dt)

        self.w_qa, self.w_qb = w(s.q_lora, s.hidden), w(heads * (s.nope + s.rope), s.q_lora)
        self.w_kva = w(s.kv_lora + s.rope, s.hidden)
        self.w_uk = (torch.randn(heads, s.nope, s.kv_lora, device=device, generator=g) * s.nope ** -0.5).to(dt)
        self.w_uv = (torch.randn(heads, s.kv_lora, s.v_head, device=device, generator=g) * s.kv_lora ** -0.5).to(dt)
        self.w_o = w(s.hidden, heads * s.v_head)
        self.w_iq, self.w_ik, self.w_ip = w(s.index_heads * s.index_dim, s.q_lora), w(s.index_dim, s.hidden), \
            w(s.index_heads, s.hidden)
        self.n_qa = torch.ones(s.q_lora, device=device, dtype=dt)
        self.n_kv = torch.ones(s.kv_lora, device=device, dtype=dt)
        self.n_x = torch.ones(s.hidden, device=device, dtype=dt)
        blocks_per_req = -(-(context + 1) // s.page)
        self.blocks_per_req = blocks_per_req
        nblocks = batch * blocks_per_req
        # drawn directly in bf16: at batch 256 x 64k context the float32 temporaries would need ~50 GB
        self.kv_cache = torch.randn(nblocks, s.page, s.kv_lora + s.rope, device=device, generator=g, dtype=dt)
        self.index_cache = torch.randn(nblocks, s.page, s.index_dim, device=device, generator=g, dtype=dt)
        self.block_table = (torch.arange(nblocks, device=device, dtype=torch.int32).view(batch, blocks_per_req))
        self.seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        self.write_slot = self.block_table[:, context // s.page].long() * s.page + context % s.page
        self.x = torch.randn(batch, s.hidden, device=device, generator=g).to(dt)
        self.scale = (s.nope + s.rope) ** -0.5
        self._flashmla = None

    # -- pieces ---------------------------------------------------------------------------------
    def projections(self):
        s, B, H = self.s, self.B, self.H
        xn = F.rms_norm(self.x, (s.hidden,), self.n_x, 1e-5)
        qa = F.rms_norm(xn @ self.w_qa.T, (s.q_lora,), self.n_qa, 1e-6)
        q = (qa @ self.w_qb.T).view(B, H, s.nope + s.rope)
        kv = xn @ self.w_kva.T
        c = F.rms_norm(kv[:, :s.kv_lora], (s.kv_lora,), self.n_kv, 1e-6)
        row = torch.cat([c, kv[:, s.kv_lora:]], dim=-1)     # rope omitted: an elementwise op on 64 values
        self.kv_cache.view(-1, row.shape[-1])[self.write_slot] = row
        q_lat = torch.bmm(q[..., :s.nope].transpose(0, 1), self.w_uk).transpose(0, 1)       # [B, H, 512]
        q_full = torch.cat([q_lat, q[..., s.nope:]], dim=-1).contiguous()
        qi = (qa @ self.w_iq.T).view(B, s.index_heads, s.index_dim)
        ki = F.layer_norm(xn @ self.w_ik.T, (s.index_dim,))
        self.index_cache.view(-1, s.index_dim)[self.write_slot] = ki
        wts = (xn @ self.w_ip.T).float() * (s.index_heads ** -0.5) * (s.index_dim ** -0.5)
        return q_full, qi, wts

    def indexer(self, impl: str, qi, wts):
        """Global slots [B, topk] of the selected rows."""
        s = self.s
        lengths = self.seq_lens + 1
        if impl == "torch":
            L = self.L + 1
            keys = self.index_cache.view(self.B, -1, s.index_dim)[:, :L]                    # contiguous per request
            logits = torch.einsum("bhd,bld->bhl", qi, keys).float().relu()
            logits = torch.einsum("bh,bhl->bl", wts, logits)
            top = torch.topk(logits, min(s.topk, L), dim=-1).indices.int()
        else:
            from glm5lab.kernels.dsa_indexer import indexer_logits_decode, indexer_topk

            logits = indexer_logits_decode(qi, wts, self.index_cache, self.block_table, lengths)
            top = indexer_topk(logits, s.topk, lengths)
        base = (torch.arange(self.B, device=top.device, dtype=torch.int32) * self.blocks_per_req * s.page)[:, None]
        return torch.where(top >= 0, top + base, torch.full_like(top, -1))

    def attention(self, impl: str, q_full, slots):
        if impl == "glm5lab":
            from glm5lab.kernels.sparse_mla import sparse_mla_attention

            return sparse_mla_attention(q_full, self.kv_cache, slots, self.scale)[0]
        if impl == "flashmla":
            from glm5lab.bench.flashmla_anchor import SparsePrefillBF16

            return SparsePrefillBF16(q_full, self.kv_cache, slots, self.scale)()[0]
        from glm5lab.bench.kernel_bench import torch_gather_attention

        return torch_gather_attention(q_full, self.kv_cache.view(-1, q_full.shape[-1]), slots, self.scale)[0]

    def output(self, latent):
        v = torch.bmm(latent.transpose(0, 1), self.w_uv).transpose(0, 1)                   # [B, H, 256]
        return v.reshape(self.B, -1) @ self.w_o.T

    def step(self, impl: str):
        q_full, qi, wts = self.projections()
        slots = self.indexer("torch" if impl == "torch" else "glm5lab", qi, wts)
        return self.output(self.attention(impl, q_full, slots))


def run_rows(profile: str = "cpu", *, time_budget_s: float = 150.0, log=print, shapes=None) -> list[dict]:
    """Sweep the profile's shapes (priority order) until the time budget is spent; returns rows."""
    from glm5lab.bench.timing import bench

    prof = PROFILES[profile]
    s = StackShape(**prof.shape_kw)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    impls = list(prof.impls)
    rows: list[dict] = []
    t0 = time.time()
    if "flashmla" in impls:
        try:
            from glm5lab.bench import flashmla_anchor

            flashmla_anchor.load()
        except Exception as exc:  # noqa: BLE001
            impls.remove("flashmla")
            rows.append({"suite": SUITE, "implementation": "flashmla", "shape": "-", "dtype": "bf16",
                         "layout": "bf16", "metric": "skipped", "value": float("nan"), "unit": str(exc)[:300]})
            log(f"  flashmla skipped: {exc}")
    shapes = list(shapes or prof.shapes)

    def timed(fn):
        return bench(fn, cpu_reps=prof.cpu_reps) if dev == "cpu" else bench(fn, warmup_ms=10, rep_ms=40)

    with torch.no_grad():
        for H, B, L in shapes:
            if time.time() - t0 > time_budget_s:
                rows.append({"suite": SUITE, "implementation": "-", "shape": f"H{H}_B{B}_L{L}", "dtype": "bf16",
                             "layout": "bf16", "metric": "skipped", "value": float("nan"),
                             "unit": "time budget spent"})
                continue
            shape = f"H{H}_B{B}_L{L}"
            try:
                layer = AttentionLayer(s, H, B, L, dev)
                q_full, qi, wts = layer.projections()
                t_proj = timed(layer.projections)
                slots_k = layer.indexer("glm5lab", qi, wts)
            except Exception as exc:  # noqa: BLE001  (e.g. out of memory at the largest shapes)
                rows.append({"suite": SUITE, "implementation": "-", "shape": shape, "dtype": "bf16",
                             "layout": "bf16", "metric": "failed", "value": float("nan"),
                             "unit": f"{type(exc).__name__}: {str(exc)[:250]}"})
                log(f"  {shape}: setup FAILED {type(exc).__name__}: {str(exc)[:200]}")
                continue
            for impl in impls:
                base = {"suite": SUITE, "implementation": impl, "shape": shape, "dtype": "bf16", "layout": "bf16"}
                try:
                    idx_impl = "torch" if impl == "torch" else "glm5lab"
                    t_idx = timed(lambda: layer.indexer(idx_impl, qi, wts))
                    t_att = timed(lambda: layer.attention(impl, q_full, slots_k))
                    latent = layer.attention(impl, q_full, slots_k)
                    t_out = timed(lambda: layer.output(latent))
                    t_step = timed(lambda: layer.step(impl))
                except Exception as exc:  # noqa: BLE001
                    rows.append({**base, "metric": "failed", "value": float("nan"),
                                 "unit": f"{type(exc).__name__}: {str(exc)[:250]}"})
                    log(f"  {shape} {impl}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                step = t_step["p50"]
                rows += [
                    {**base, "metric": "step_time", "value": step, "unit": "us", **t_step},
                    {**base, "metric": "attention_time", "value": t_att["p50"], "unit": "us", **t_att},
                    {**base, "metric": "indexer_time", "value": t_idx["p50"], "unit": "us", **t_idx},
                    {**base, "metric": "projection_time", "value": t_proj["p50"], "unit": "us", **t_proj},
                    {**base, "metric": "output_time", "value": t_out["p50"], "unit": "us", **t_out},
                    {**base, "metric": "attention_share", "value": t_att["p50"] / step, "unit": "fraction"},
                    {**base, "metric": "indexer_share", "value": t_idx["p50"] / step, "unit": "fraction"},
                    {**base, "metric": "layer_tokens_per_s", "value": B / (step * 1e-6), "unit": "tok/s"},
                    {**base, "metric": "stack78_tokens_per_s", "value": B / (GLM5_LAYERS * step * 1e-6),
                     "unit": "tok/s"},
                ]
                log(f"  {shape:18s} {impl:8s} step {step:9.1f} us  attention {t_att['p50']:8.1f} us "
                    f"({t_att['p50'] / step:4.0%})  indexer {t_idx['p50']:8.1f} us  "
                    f"78-layer {B / (GLM5_LAYERS * step * 1e-6):9.0f} tok/s")
            layer = q_full = qi = wts = slots_k = None    # (the shape's tensors go; unbound, not del: the
            # timed lambdas above name them, and a del reads to pyflakes as a use of unbound names)
            if dev == "cuda":
                torch.cuda.empty_cache()
    return rows


def stack_table(df):
    """step time / attention share / tokens/s per shape and implementation, from CSV rows."""
    import pandas as pd

    d = df[(df.suite == SUITE) & df.metric.isin(["step_time", "attention_time", "attention_share",
                                                  "stack78_tokens_per_s"])].copy()
    if d.empty:
        return pd.DataFrame()
    d["value"] = pd.to_numeric(d.value, errors="coerce")
    return d.pivot_table(index=["shape", "implementation"], columns="metric", values="value", aggfunc="last")


def parse_shape(shape: str) -> dict:
    """'H8_B32_L4096' -> {'H': 8, 'B': 32, 'L': 4096}."""
    out = {}
    for part in shape.split("_"):
        if part[:1] in "HBL" and part[1:].isdigit():
            out[part[0]] = int(part[1:])
    return out
