"""glm5lab's own GLM-5 decode path: the model as a serving engine runs it, not as transformers does.

Why it exists: transformers' `GlmMoeDsaForCausalLM` expands the MLA latent into per-head keys/values and
applies the DSA top-k as a dense mask. A serving engine instead keeps ONE latent row per token
(c_kv 512 + roped k_pe 64 = 576 values) in its KV cache, absorbs `kv_b_proj` into the query and the
output, and hands the attention kernel each token's list of selected cache slots. This module runs the
tiny GLM-5 exactly that way, with glm5lab's kernel (or the float64 reference) doing the attention, so
that comparing its logits with transformers' proves the whole path (weights from the GGUF, absorption,
latent cache, indexer top-k, sparse kernel) and not only the kernel in isolation.

Layout conventions copied from transformers (so the numbers can match to rounding):
- the main attention's q head is [nope 192 | rope 64]; the indexer's head is [rope 64 | pass 64];
- both use *interleaved* RoPE whose output is written de-interleaved (evens then odds), which changes no
  dot product because q and k are permuted alike;
- the indexer score is sum_h w_h * relu(q_h . k * d^-0.5), w = weights_proj(x) * n_heads^-0.5, causal;
  `indexer_types[layer] == "shared"` layers reuse the previous layer's top-k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from glm5lab.errors import Glm5labError
from glm5lab.sparse.reference import mla_softmax_scale, sparse_mla_reference

ATTENTION_IMPLS = ("kernel", "vbt", "reference")
INDEXER_IMPLS = ("kernel", "reference")


# --------------------------------------------------------------------------------------------- helpers
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * x32


def _rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] with cos/sin [T, d/2]: rotate pairs (x0,x1),(x2,x3)... and write evens then odds."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rope_tables(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim/2] for these positions; non-default rope types use transformers' init functions
    (the frequencies are config math, not model code)."""
    rope = dict(config.rope_parameters or {})
    dim = config.qk_rope_head_dim
    if rope.get("rope_type", "default") == "default":
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def attention_scale(config) -> float:
    """The model's softmax scale: 1/sqrt(qk_nope + qk_rope), times YaRN's mscale^2 when rope is scaled."""
    rope = dict(config.rope_parameters or {})
    mscale = 1.0
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
    return mla_softmax_scale(config.qk_nope_head_dim, config.qk_rope_head_dim, mscale)


def _call_attention(impl: str, q, kv_cache, slots, scale, kv_lora_rank) -> torch.Tensor:
    """Latent attention output [T, H, kv_lora_rank] in float32 from the chosen implementation:
    "kernel" = glm5lab's fused sparse kernel, "vbt" = glm5lab's paged decode kernel on the virtual block
    table (the original deployment's route), "reference" = float64 torch."""
    if impl == "reference":
        out, _ = sparse_mla_reference(q, kv_cache, slots, scale, kv_lora_rank=kv_lora_rank)
    elif impl == "kernel":
        from glm5lab.kernels.sparse_mla import sparse_mla_attention

        out, _ = sparse_mla_attention(q, kv_cache, slots.to(torch.int32), scale, kv_lora_rank=kv_lora_rank)
    else:
        from glm5lab.sparse.virtual_block_table import virtual_block_table_attention

        out, _ = virtual_block_table_attention(q, kv_cache, slots.to(torch.int32), scale, kv_lora_rank)
    return out.float()


# ---------------------------------------------------------------------------------------------- indexer
def topk_margin(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: (k-th largest - (k+1)-th largest) / max |logit| over the causal row; NaN where the row
    has <= k keys (it selects everything, nothing can flip). A small margin is a near-tie: any rounding
    difference may swap which key is selected."""
    out = torch.full((logits.shape[0],), float("nan"))
    L = logits.shape[1]
    if L <= k:
        return out
    x = logits.float().masked_fill(torch.arange(L, device=logits.device)[None, :] >= lengths[:, None].to(logits.device),
                                   float("-inf"))
    top = x.topk(k + 1, dim=-1).values
    scale = x.masked_fill(torch.isinf(x), 0).abs().amax(-1).clamp(min=1e-30)
    m = ((top[:, k - 1] - top[:, k]) / scale).cpu()
    return torch.where(lengths.cpu() > k, m, out)


def indexer_topk(q_idx: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor,
                 positions: torch.Tensor, topk: int, impl: str = "reference",
                 return_logits: bool = False):
    """DSA top-k for T query tokens of one sequence: q_idx [T, Hi, d] (roped), k_cache [L, d] (roped keys
    of positions 0..L-1), weights [T, Hi] (both scales folded in, as `head_weights` returns), positions
    [T]. Returns request-local positions [T, topk] (int32, ascending, -1 padded); a row whose causal
    context is <= topk selects all of it. impl "kernel" = glm5lab.kernels.dsa_indexer (Triton logits +
    radix top-k), "reference" = glm5lab.sparse.indexer_reference (torch)."""
    lengths = positions.long() + 1
    if impl == "reference":
        from glm5lab.sparse.indexer_reference import indexer_logits_reference, indexer_topk_reference

        logits = indexer_logits_reference(q_idx, k_cache, weights, lengths)
        top = indexer_topk_reference(logits, topk, lengths)
        return (top, logits) if return_logits else top
    from glm5lab.kernels.dsa_indexer import indexer_logits_prefill
    from glm5lab.kernels.dsa_indexer import indexer_topk as topk_kernel

    ks = torch.zeros_like(lengths, dtype=torch.int32)
    logits = indexer_logits_prefill(q_idx.contiguous(), weights.float().contiguous(), k_cache.to(q_idx.dtype).contiguous(),
                                    ks, lengths.to(torch.int32), max_len=k_cache.shape[0])
    top = topk_kernel(logits, topk, lengths.to(torch.int32))
    return (top, logits) if return_logits else top


# ------------------------------------------------------------------------------------------------ model
@dataclass
class DecodeStats:
    """What the sparse path actually did, per call: used to show the top-k is a strict subset."""
    selected: list[int] = field(default_factory=list)   # valid slots per query token (last layer seen)
    context: list[int] = field(default_factory=list)    # causal context length per query token
    slots: dict = field(default_factory=dict)           # layer -> [positions so far, topk] DSA selections
    margins: dict = field(default_factory=dict)         # layer -> [positions so far] relative k-th gap

    def min_margin(self) -> float:
        """Smallest relative k-th-score gap over every layer and position that had a real choice."""
        vals = [torch.cat(v) for v in self.margins.values() if v]
        if not vals:
            return float("nan")
        m = torch.cat(vals)
        m = m[~torch.isnan(m)]
        return float(m.min()) if m.numel() else float("nan")

    def margins_at(self, positions: list[int]) -> list[float]:
        """Smallest gap over the layers at each given position."""
        per_layer = [torch.cat(v) for v in self.margins.values() if v]
        out = []
        for t in positions:
            vals = [float(m[t]) for m in per_layer if t < m.numel() and not torch.isnan(m[t])]
            out.append(min(vals) if vals else float("nan"))
        return out

    def topk_sets(self, layer: int) -> list[set]:
        """The DSA selection of every position processed since reset, as sets of positions."""
        rows = torch.cat(self.slots.get(layer, []), dim=0) if self.slots.get(layer) else torch.empty(0, 0)
        return [set(int(j) for j in r if j >= 0) for r in rows]


class Glm5Decoder:
    """GLM-5 forward over an MLA latent KV cache, one or many new tokens per call.

    `state_dict` uses transformers' parameter names (what `weights_from_gguf` returns).
    attention: "kernel" (glm5lab.kernels.sparse_mla), "vbt" (paged kernel on the virtual block table) or
    "reference" (float64 torch). indexer: "kernel" (glm5lab.kernels.dsa_indexer) or "reference".
    dense=True disables DSA: every token attends to its whole causal context (the dense-vs-sparse check).
    kv_dtype: the cache's dtype (the kernel wants fp16/bf16; the reference takes any).
    """

    def __init__(self, config, state_dict: dict[str, torch.Tensor], *, attention: str = "kernel",
                 indexer: str = "kernel", dense: bool = False, kv_dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 max_len: int = 256, block_size: int = 16):
        if attention not in ATTENTION_IMPLS:
            raise Glm5labError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        if indexer not in INDEXER_IMPLS:
            raise Glm5labError(f"indexer must be one of {INDEXER_IMPLS}, got {indexer!r}")
        if attention != "reference" and kv_dtype not in (torch.float16, torch.bfloat16):
            raise Glm5labError(f"attention={attention!r} needs a float16/bfloat16 KV cache, got {kv_dtype}")
        self.indexer = indexer
        self.config, self.attention, self.dense = config, attention, dense
        self.kv_dtype, self.device, self.block_size = kv_dtype, torch.device(device), block_size
        self.w = {k: v.to(self.device, torch.float32) for k, v in state_dict.items()}
        self._check_weights()
        self.scale = attention_scale(config)
        self.max_len = -(-max_len // block_size) * block_size
        self.stats = DecodeStats()
        self.reset()

    def _check_weights(self) -> None:
        c = self.config
        need = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            need += [p + "q_a_proj.weight", p + "q_b_proj.weight", p + "kv_a_proj_with_mqa.weight",
                     p + "kv_b_proj.weight", p + "o_proj.weight"]
        missing = [k for k in need if k not in self.w]
        if missing:
            raise Glm5labError(f"decode weights lack {len(missing)} tensors, first: {missing[0]}")

    # -- cache ------------------------------------------------------------------------------------
    def reset(self) -> None:
        c = self.config
        width = c.kv_lora_rank + c.qk_rope_head_dim
        self.kv = [torch.zeros(self.max_len // self.block_size, self.block_size, width,
                               dtype=self.kv_dtype, device=self.device) for _ in range(c.num_hidden_layers)]
        self.index_k = [torch.zeros(self.max_len, c.index_head_dim, device=self.device)
                        for _ in range(c.num_hidden_layers)]
        self.length = 0
        self.stats = DecodeStats()

    # -- layers -----------------------------------------------------------------------------------
    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        return self._lin(prefix + "down_proj", F.silu(self._lin(prefix + "gate_proj", x)) * self._lin(prefix + "up_proj", x))

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}.mlp."
        scores = F.linear(x, self.w[p + "gate.weight"]).sigmoid()
        choice = scores + self.w[p + "gate.e_score_correction_bias"]
        E = choice.shape[-1]
        group = choice.view(-1, c.n_group, E // c.n_group).topk(2, dim=-1)[0].sum(-1)
        gidx = group.topk(c.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(group).scatter_(1, gidx, 1).bool()
        emask = gmask[:, :, None].expand(-1, c.n_group, E // c.n_group).reshape(-1, E)
        top = choice.masked_fill(~emask, float("-inf")).topk(c.num_experts_per_tok, dim=-1, sorted=False)[1]
        wts = scores.gather(1, top)
        if c.norm_topk_prob:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * c.routed_scaling_factor
        gate_up, down = self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"]
        out = torch.zeros_like(x)
        for e in top.unique().tolist():
            tok, slot = torch.where(top == e)
            g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * wts[tok, slot, None])
        return out + self._mlp(p + "shared_experts.", x)

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, cos, sin,
                   prev_slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        c, p = self.config, f"model.layers.{i}.self_attn."
        T, H = x.shape[0], c.num_attention_heads
        nope, rope, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q_resid = _rms_norm(self._lin(p + "q_a_proj", x), self.w[p + "q_a_layernorm.weight"], 1e-6)
        q = self._lin(p + "q_b_proj", q_resid).view(T, H, nope + rope)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        ckv = self._lin(p + "kv_a_proj_with_mqa", x)
        c_kv = _rms_norm(ckv[:, :rank], self.w[p + "kv_a_layernorm.weight"], 1e-6)
        k_rot = _rope_interleave(ckv[:, None, rank:], cos, sin)[:, 0]
        q_rot = _rope_interleave(q_rot, cos, sin)
        flat = self.kv[i].view(-1, rank + rope)
        flat[positions] = torch.cat([c_kv, k_rot], dim=-1).to(self.kv_dtype)

        # weight absorption: kv_b_proj = [H, nope + v, rank]; q_nope . (W_uk c) == (W_uk^T q_nope) . c
        kv_b = self.w[p + "kv_b_proj.weight"].view(H, nope + c.v_head_dim, rank)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, kv_b[:, :nope])
        q_full = torch.cat([q_latent, q_rot], dim=-1)

        slots = self._select(i, x, q_resid, positions, cos, sin, prev_slots)
        q_in = q_full if self.attention == "reference" else q_full.to(self.kv_dtype)
        out_latent = _call_attention(self.attention, q_in, self.kv[i], slots, self.scale, rank)
        v = torch.einsum("thr,hvr->thv", out_latent, kv_b[:, nope:])
        return self._lin(p + "o_proj", v.reshape(T, -1)), slots

    def _select(self, i, x, q_resid, positions, cos, sin, prev_slots) -> torch.Tensor:
        """Global cache slots each new token attends to: the DSA top-k, or everything when dense."""
        c, p = self.config, f"model.layers.{i}.self_attn.indexer."
        L = int(positions.max()) + 1
        has_indexer = (p + "wk.weight") in self.w
        if has_indexer:  # keep the index-key cache current even when dense, so dense/sparse share state
            k = F.layer_norm(self._lin(p + "wk", x), (c.index_head_dim,), self.w[p + "k_norm.weight"],
                             self.w[p + "k_norm.bias"], 1e-6)
            rope = c.qk_rope_head_dim
            k = torch.cat([_rope_interleave(k[:, None, :rope], cos, sin)[:, 0], k[:, rope:]], dim=-1)
            self.index_k[i][positions] = k
        if self.dense:
            j = torch.arange(L, device=x.device)
            return torch.where(j[None, :] <= positions[:, None], j[None, :], torch.full_like(j, -1)[None, :])
        if not has_indexer:
            if prev_slots is None:
                raise Glm5labError(f"layer {i} shares the top-k but no earlier layer computed one")
            return prev_slots
        T, Hi, D = x.shape[0], c.index_n_heads, c.index_head_dim
        qi = self._lin(p + "wq_b", q_resid).view(T, Hi, D)
        rope = c.qk_rope_head_dim
        qi = torch.cat([_rope_interleave(qi[..., :rope], cos, sin), qi[..., rope:]], dim=-1)
        weights = self._lin(p + "weights_proj", x) * (Hi ** -0.5) * (D ** -0.5)
        slots, logits = indexer_topk(qi, self.index_k[i][:L], weights, positions, c.index_topk, self.indexer,
                                     return_logits=True)
        self.stats.slots.setdefault(i, []).append(slots.cpu())
        self.stats.margins.setdefault(i, []).append(topk_margin(logits, positions.long() + 1, c.index_topk))
        self.stats.selected = (slots >= 0).sum(-1).tolist()
        self.stats.context = (positions + 1).tolist()
        return slots

    # -- forward ----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append these tokens (prefill when several, decode when one); returns float32 logits [T, vocab]."""
        c = self.config
        ids = token_ids.to(self.device).view(-1)
        T = ids.numel()
        if self.length + T > self.max_len:
            raise Glm5labError(f"sequence of {self.length + T} tokens exceeds the cache ({self.max_len})")
        positions = torch.arange(self.length, self.length + T, device=self.device)
        cos, sin = _rope_tables(c, positions)
        h = self.w["model.embed_tokens.weight"][ids]
        prev = None
        for i in range(c.num_hidden_layers):
            lp = f"model.layers.{i}."
            a, prev = self._attention(i, _rms_norm(h, self.w[lp + "input_layernorm.weight"], c.rms_norm_eps),
                                      positions, cos, sin, prev)
            h = h + a
            x = _rms_norm(h, self.w[lp + "post_attention_layernorm.weight"], c.rms_norm_eps)
            h = h + (self._moe(i, x) if (lp + "mlp.gate.weight") in self.w else self._mlp(lp + "mlp.", x))
        self.length += T
        return F.linear(_rms_norm(h, self.w["model.norm.weight"], c.rms_norm_eps), self.w["lm_head.weight"])

    def greedy(self, prompt_ids: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Prefill the prompt in one call, then decode one token per call. Returns (new token ids,
        logits [prompt_len + new_tokens - 1, vocab] for every position whose next token was predicted)."""
        self.reset()
        logits = [self.forward(prompt_ids)]
        out = []
        for n in range(new_tokens):
            nxt = int(logits[-1][-1].argmax())
            out.append(nxt)
            if n + 1 < new_tokens:
                logits.append(self.forward(torch.tensor([nxt])))
        return out, torch.cat(logits, dim=0)


# ------------------------------------------------------------------------------------------ weights
def weights_from_hf_model(model) -> dict[str, torch.Tensor]:
    """transformers' parameter names -> float32 tensors (used for the reference-weights comparison)."""
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert on-disk names (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the real checkpoint's and
    the GGUF reader's layout) -> transformers' in-memory 3-D `experts.gate_up_proj` [E, 2I, D] and
    `experts.down_proj` [E, D, I]. Other tensors pass through."""
    import re

    pat = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    out, experts = {}, {}
    for name, t in state.items():
        m = pat.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, per in experts.items():
        ids = sorted(per)
        if ids != list(range(len(ids))) or any(len(per[e]) != 3 for e in ids):
            raise Glm5labError(f"{prefix}: incomplete expert set {ids[:5]}...")
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([per[e]["gate"], per[e]["up"]], 0) for e in ids])
        out[prefix + "down_proj"] = torch.stack([per[e]["down"] for e in ids])
    return out


def weights_from_gguf(path) -> dict[str, torch.Tensor]:
    """A glm-dsa GGUF read by glm5lab.gguf's reader (dequantized to float32, kv_b_proj re-joined from
    attn_k_b/attn_v_b), returned under transformers' parameter names."""
    from glm5lab.gguf.reader import read_hf_tensors

    state = {k: torch.from_numpy(v.copy()).float() for k, v in read_hf_tensors(path).items()}
    return fuse_experts(state)


def decoder_from_gguf(path, **kwargs) -> Glm5Decoder:
    """The decode path built from the GGUF alone: config from its metadata, weights from its tensors."""
    from glm5lab.gguf.config import hf_config_from_gguf

    return Glm5Decoder(hf_config_from_gguf(path), weights_from_gguf(path), **kwargs)
