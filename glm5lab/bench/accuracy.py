"""Accuracy of every sparse-MLA implementation against the float64 reference, and of glm5lab's whole
decode path against transformers.

Kernel accuracy (`kernel_accuracy`): each implementation runs on the SAME q, cache and slots; its output
is compared with `sparse_mla_reference` in float64 on the cache exactly as the implementation reads it
(bf16/fp16 as stored, fp8_ds_mla DEQUANTIZED), so the number is the kernel's own error. What storing the
cache costs is measured separately, as its own rows: the float64 reference on the stored cache vs the
float64 reference on the float32 source rows ("storage error"; for fp8_ds_mla, the quantization error).

Model accuracy (`model_accuracy`): the tiny GLM-5 through transformers' `GlmMoeDsaForCausalLM` (the
reference) and through `glm5lab.model.decode.Glm5Decoder` built from the GGUF: per-position logits
error, top-1 agreement, whether greedy continuations of a 64-token prompt are identical, and the
dense-vs-sparse effect (DSA off: attend to the whole context), which shows the top-k is not a no-op.
The primary reference is transformers holding the GGUF's own (dequantized) weights, which isolates
glm5lab's path; the float32 HF checkpoint is compared too (`*_vs_checkpoint`), which adds what the GGUF
quantization does. The DSA top-k is discontinuous: a near-tie at the k-th score flips under any rounding
difference, so the rows also count positions whose selection differs from transformers' (`topk_flip_*`)
and give the error over the positions whose selections agree.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

SUITE_KERNEL = "kernel_accuracy"
SUITE_MODEL = "model_accuracy"


@dataclass(frozen=True)
class KernelShapes:
    num_slots: int
    block_size: int
    topk: int
    heads: tuple
    tokens: int
    time_it: bool


KERNEL_PROFILES = {
    "gpu": KernelShapes(524_288, 64, 2048, (8, 64, 128), 32, True),
    "cpu": KernelShapes(512, 64, 48, (8,), 3, False),
}


def _err_rows(base: dict, out, lse, ref_out, ref_lse) -> list[dict]:
    o = out.double()
    diff = (o - ref_out)
    rel = float(diff.norm() / ref_out.norm().clamp(min=1e-30))
    fin = torch.isfinite(ref_lse)
    lse_err = float((lse.double() - ref_lse)[fin].abs().max()) if bool(fin.any()) else 0.0
    if not bool(torch.isfinite(o).all()):
        rel = float("nan")
    return [{**base, "metric": "max_abs_err_out", "value": float(diff.abs().max()), "unit": "abs"},
            {**base, "metric": "rel_err_out", "value": rel, "unit": "rel_frobenius"},
            {**base, "metric": "max_abs_err_lse", "value": lse_err, "unit": "abs"}]


def implementations(q, caches: dict, slots, scale, *, with_flashmla: bool, log=print) -> list[tuple]:
    """(name, layout, callable -> (out, lse)) for every implementation that can run here. Absent ones are
    returned as (name, layout, reason-string) so they become 'skipped' rows, not silent gaps."""
    from glm5lab.bench.kernel_bench import torch_gather_attention
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.virtual_block_table import virtual_block_table_attention

    impls: list[tuple] = []
    for lay in ("bf16", "fp16", "fp8_ds_mla"):
        cache = caches[lay]["stored"]
        qq = q.to(torch.float16) if lay == "fp16" else q
        impls.append(("glm5lab-fused", lay, lambda qq=qq, cache=cache: sparse_mla_attention(qq, cache, slots, scale)))
        if lay != "fp8_ds_mla":
            impls.append(("glm5lab-vbt", lay, lambda qq=qq, cache=cache: virtual_block_table_attention(
                qq, cache, slots, scale, validate=False)))
            flat = cache.view(-1, cache.shape[-1])
            impls.append(("torch-gather", lay, lambda qq=qq, flat=flat: torch_gather_attention(qq, flat, slots, scale)))
    try:
        from glm5lab.vllm_plugin.triton_decode_vbt import vllm_decode_attention_on_vbt, vllm_triton_decode_status
        from glm5lab.sparse.virtual_block_table import virtual_block_table_from_slots

        status = vllm_triton_decode_status()
    except Exception as exc:  # noqa: BLE001
        status = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    if status["available"]:
        vbt = virtual_block_table_from_slots(slots)
        cache = caches["bf16"]["stored"]
        impls.append(("vllm-triton-vbt", "bf16", lambda: vllm_decode_attention_on_vbt(q, cache, vbt, scale)))
    else:
        impls.append(("vllm-triton-vbt", "bf16", status["reason"]))
    if with_flashmla:
        try:
            from glm5lab.bench import flashmla_anchor

            flashmla_anchor.load()
            impls.append(("flashmla", "fp8_ds_mla",
                          flashmla_anchor.SparseDecodeFP8(q, caches["fp8_ds_mla"]["stored"], slots, scale)))
            impls.append(("flashmla", "bf16", flashmla_anchor.SparsePrefillBF16(q, caches["bf16"]["stored"], slots, scale)))
        except Exception as exc:  # noqa: BLE001
            impls.append(("flashmla", "fp8_ds_mla", f"{type(exc).__name__}: {str(exc)[:200]}"))
    else:
        impls.append(("flashmla", "fp8_ds_mla", "no GPU: FlashMLA needs SM90/SM100"))
    return impls


def kernel_accuracy(profile: str = "cpu", *, seed: int = 0, log=print, time_budget_s: float | None = None) -> list[dict]:
    """Rows: per implementation x layout x head count, max/relative error of out and lse vs float64;
    plus storage/quantization error rows; plus time rows on the GPU. Never raises for one implementation."""
    from glm5lab.bench.timing import bench
    from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
    from glm5lab.sparse.reference import mla_softmax_scale, sparse_mla_reference

    shp = KERNEL_PROFILES[profile]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    nblocks = shp.num_slots // shp.block_size
    source = torch.randn(nblocks, shp.block_size, 576, device=dev, generator=gen)       # float32 "truth"
    caches = {}
    for lay, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        stored = source.to(dt)
        caches[lay] = {"stored": stored, "read": stored}
    fp8 = quantize_fp8_ds_mla(source.to(torch.bfloat16))
    caches["fp8_ds_mla"] = {"stored": fp8, "read": dequantize_fp8_ds_mla(fp8)}
    scale = mla_softmax_scale()
    rows: list[dict] = []
    t_start = time.time()

    # what the cache format costs by itself: reference on stored cache vs reference on the float32 source
    src_flat = source.view(-1, 576)
    for lay, c in caches.items():
        read = c["read"].reshape(-1, 576).double()
        d = (read - src_flat.double())
        base = {"suite": SUITE_KERNEL, "implementation": "cache-storage", "shape": f"slots{shp.num_slots}",
                "dtype": lay, "layout": lay}
        rows.append({**base, "metric": "cache_max_abs_err", "value": float(d.abs().max()), "unit": "abs"})
        rows.append({**base, "metric": "cache_rel_err", "value": float(d.norm() / src_flat.double().norm()),
                     "unit": "rel_frobenius"})

    for H in shp.heads:
        T = shp.tokens
        shape = f"H{H}_T{T}_K{shp.topk}"
        q = torch.randn(T, H, 576, device=dev, generator=gen).to(torch.bfloat16)
        slots = torch.randint(0, shp.num_slots, (T, shp.topk), device=dev, dtype=torch.int32, generator=gen)
        pad = torch.rand(T, shp.topk, device=dev, generator=gen) < 0.1          # -1 anywhere in the row
        slots = torch.where(pad, torch.full_like(slots, -1), slots)
        refs = {lay: sparse_mla_reference(q.to(torch.float16) if lay == "fp16" else q, c["read"], slots, scale)
                for lay, c in caches.items()}
        src_ref = sparse_mla_reference(q, source, slots, scale)
        for lay in caches:   # storage / quantization error, kept apart from kernel error
            rows += _err_rows({"suite": SUITE_KERNEL, "implementation": f"{lay}-storage", "shape": shape,
                               "dtype": "float64", "layout": lay}, *refs[lay], *src_ref)
        for name, lay, fn in implementations(q, caches, slots, scale, with_flashmla=(dev == "cuda"), log=log):
            base = {"suite": SUITE_KERNEL, "implementation": name, "shape": shape,
                    "dtype": "fp16" if lay == "fp16" else "bf16", "layout": lay}
            if isinstance(fn, str):
                rows.append({**base, "metric": "skipped", "value": float("nan"), "unit": fn[:300]})
                log(f"  {shape} {name} {lay}: skipped ({fn[:120]})")
                continue
            if time_budget_s is not None and time.time() - t_start > time_budget_s:
                rows.append({**base, "metric": "skipped", "value": float("nan"), "unit": "time budget spent"})
                continue
            try:
                out, lse = fn()
                new = _err_rows(base, out, lse, *refs[lay])
                if shp.time_it:
                    t = bench(fn)
                    new.append({**base, "metric": "time", "value": t["p50"], "unit": "us", **t})
                rows += new
                log(f"  {shape:18s} {name:16s} {lay:10s} rel err {new[1]['value']:.2e}  "
                    f"max abs {new[0]['value']:.2e}  lse {new[2]['value']:.2e}")
            except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the part)
                rows.append({**base, "metric": "failed", "value": float("nan"),
                             "unit": f"{type(exc).__name__}: {str(exc)[:250]}"})
                log(f"  {shape} {name} {lay}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
        del q, slots, refs
    return rows


def accuracy_table(df):
    """The kernel accuracy table from CSV rows: implementation x layout -> worst relative/lse error."""
    import pandas as pd

    d = df[(df.suite == SUITE_KERNEL) & df.metric.isin(["rel_err_out", "max_abs_err_out", "max_abs_err_lse"])]
    if d.empty:
        return pd.DataFrame()
    d = d.assign(value=pd.to_numeric(d.value, errors="coerce"))
    return d.pivot_table(index=["implementation", "layout"], columns="metric", values="value", aggfunc="max")


# ----------------------------------------------------------------------------------------- model level
# variants per GGUF type: (label, attention, indexer, kv-cache dtype). The CPU profile keeps the
# interpreter's work small: the fused kernel on F16 weights, the float64 reference on both types.
_REF = ("reference", "reference", "reference", "float32")
MODEL_PROFILES = {
    "cpu": dict(new_tokens=4, variants={
        "F16": (_REF, ("glm5lab-fused-fp16", "kernel", "reference", "float16")),
        "Q8_0": (_REF,)}),
    "gpu": dict(new_tokens=32, variants={
        "F16": (_REF, ("glm5lab-fused-fp16", "kernel", "kernel", "float16"),
                ("glm5lab-fused-bf16", "kernel", "kernel", "bfloat16"),
                ("glm5lab-vbt-bf16", "vbt", "kernel", "bfloat16")),
        "Q8_0": (_REF, ("glm5lab-fused-fp16", "kernel", "kernel", "float16"))}),
}


PROMPT_TEXTS = (
    "The sparse indexer scores every earlier token and keeps the top tokens; attention then reads only the "
    "tokens the indexer kept. Engineers who serve large models care about memory. ",
    "The quick brown fox jumps over the lazy dog. Tell me a story about a small robot who learned to count "
    "the stars in the night sky over the sea. ",
    "A quantized file stores each tensor in blocks; every block of thirty two numbers shares one scale. The "
    "loader maps the names in the file to the names in the model. ",
    "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)\n",
)


def prompt_ids(n: int = 64, text: str = PROMPT_TEXTS[0]) -> torch.Tensor:
    """An n-token prompt from the tiny tokenizer (real text, repeated to length): with the tiny model's
    top-k of 32, a 64-token prompt makes DSA select a strict subset at every position >= 32."""
    from glm5lab.model.tiny import build_tiny_tokenizer

    ids = build_tiny_tokenizer().encode(text * 16).ids
    return torch.tensor(ids[:n], dtype=torch.long)


def choose_prompt(config, state: dict, n: int = 64) -> tuple[torch.Tensor, list[float]]:
    """The candidate prompt whose smallest DSA k-th-score gap (float64 reference, these weights) is the
    largest, and every candidate's gap. Why: at a near-tie any rounding (an fp16 cache) may flip which key
    is selected; with ~100 (layer, position) choices per prompt some gaps are ~1e-4 of the scores, so the
    rule picks the prompt where the comparison measures the path, not a coin flip. Stated, not hidden."""
    from glm5lab.model.decode import Glm5Decoder

    margins = []
    for text in PROMPT_TEXTS:
        dec = Glm5Decoder(config, state, attention="reference", indexer="reference", kv_dtype=torch.float32,
                          max_len=n + 8)
        dec.forward(prompt_ids(n, text))
        margins.append(dec.stats.min_margin())
    best = max(range(len(margins)), key=lambda i: margins[i])
    return prompt_ids(n, PROMPT_TEXTS[best]), margins


def _hf_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids[None]).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([nxt])])
    return out


def hf_topk_sets(model, ids: torch.Tensor) -> dict[int, list[set]]:
    """transformers' own DSA selections for a prompt: layer -> per-position set of causal positions
    (its top-k over a short causal row also returns masked positions; those are dropped)."""
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        idx = getattr(layer.self_attn, "indexer", None)
        if idx is not None:
            hooks.append(idx.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[0].cpu())))
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return {i: [set(int(j) for j in row if int(j) <= t) for t, row in enumerate(rows)] for i, rows in got.items()}


def topk_disagreements(stats, hf_sets: dict[int, list[set]]) -> list[int]:
    """Positions where glm5lab's DSA selection differs from transformers' in any indexer layer. Near-ties at
    the k-th score flip under any rounding difference; logits at such positions legitimately differ."""
    bad = set()
    for layer, sets in hf_sets.items():
        mine = stats.topk_sets(layer)
        for t in range(min(len(mine), len(sets))):
            if mine[t] != sets[t]:
                bad.add(t)
    return sorted(bad)


def hf_model_with_state(config, state: dict):
    """transformers' model holding exactly these (e.g. GGUF-dequantized) weights: separates what the GGUF
    quantization changes from what glm5lab's decode path changes."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("e_score_correction_bias")]
    if missing or unexpected:
        from glm5lab.errors import Glm5labError

        raise Glm5labError(f"GGUF weights do not fit the HF model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def model_accuracy(profile: str = "cpu", *, log=print, qtypes=None, variants=None, new_tokens=None,
                   dense_check: bool = True) -> list[dict]:
    """Rows comparing glm5lab's decode path (weights from the GGUF) with transformers (HF checkpoint)."""
    from glm5lab.gguf.config import hf_config_from_gguf
    from glm5lab.model.decode import Glm5Decoder, weights_from_gguf, weights_from_hf_model
    from glm5lab.model.tiny import build_tiny_model, ensure_tiny

    prof = MODEL_PROFILES[profile]
    variants = variants or prof["variants"]
    qtypes = qtypes or tuple(variants)
    new_tokens = new_tokens or prof["new_tokens"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    paths = ensure_tiny(qtypes=tuple(qtypes))
    ref_model = build_tiny_model(0)
    ref_model.config._attn_implementation = "eager"
    rows: list[dict] = []

    def add(impl, shape, metric, value, unit, dtype="float32", layout="-"):
        rows.append({"suite": SUITE_MODEL, "implementation": impl, "shape": shape, "dtype": dtype,
                     "layout": layout, "metric": metric, "value": float(value), "unit": unit})

    # chosen on the float32 checkpoint, so every GGUF type (and every call) gets the same prompt
    prompt, margins = choose_prompt(ref_model.config, weights_from_hf_model(ref_model))
    for i, m in enumerate(margins):
        add("prompt-choice", f"candidate{i}", "min_topk_relative_margin", m, "relative", layout="checkpoint")
    P = prompt.numel()
    ref_tokens = _hf_greedy(ref_model, prompt, new_tokens)

    for qt in qtypes:
        gpath = paths.gguf(qt)
        config = hf_config_from_gguf(gpath)
        state = weights_from_gguf(gpath)
        same_w = hf_model_with_state(config, state)   # transformers on the GGUF's own weights
        same_w.config._attn_implementation = "eager"
        shape = f"tiny_{qt}_prompt{P}_new{new_tokens}"
        same_tokens = _hf_greedy(same_w, prompt, new_tokens)
        add("gguf-weights-in-transformers", shape, "greedy_identical_vs_checkpoint", same_tokens == ref_tokens,
            "bool", layout=qt)
        for label, attn, idx, kvd in variants.get(qt, (_REF,)):
            t0 = time.time()
            try:
                dec = Glm5Decoder(config, state, attention=attn, indexer=idx, kv_dtype=getattr(torch, kvd),
                                  device=dev, max_len=P + new_tokens + 16)
                toks, logits = dec.greedy(prompt.to(dev), new_tokens)
                logits = logits.cpu()
                selected, context = dec.stats.selected, dec.stats.context
                seq = torch.cat([prompt, torch.tensor(toks[:-1], dtype=torch.long)])
                with torch.no_grad():
                    ref_logits = ref_model(seq[None]).logits[0]
                    same_logits = same_w(seq[None]).logits[0]
                # primary reference: transformers holding the SAME (GGUF-dequantized) weights, so the numbers
                # measure glm5lab's path; the float32 checkpoint adds the GGUF quantization effect on top
                err = (logits - same_logits).abs().amax(-1)                   # per position
                err_ckpt = (logits - ref_logits).abs().amax(-1)
                flips = topk_disagreements(dec.stats, hf_topk_sets(same_w, seq))
                flips_ckpt = topk_disagreements(dec.stats, hf_topk_sets(ref_model, seq))
                agree = torch.ones(err.numel(), dtype=torch.bool)
                agree[flips] = False
                top1 = (logits.argmax(-1) == same_logits.argmax(-1)).float().mean()
                top1_ckpt = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
                base = dict(dtype=kvd, layout=qt)
                add(label, shape, "logits_max_abs_err", err.max(), "abs", **base)
                add(label, shape, "logits_mean_abs_err", (logits - same_logits).abs().mean(), "abs", **base)
                add(label, shape, "logits_max_abs_err_topk_agreeing",
                    err[agree].max() if bool(agree.any()) else float("nan"), "abs", **base)
                add(label, shape, "logits_max_abs_err_vs_checkpoint", err_ckpt.max(), "abs", **base)
                add(label, shape, "topk_flip_positions", len(flips), "positions", **base)
                add(label, shape, "topk_flip_positions_vs_checkpoint", len(flips_ckpt), "positions", **base)
                flip_m = [m for m in dec.stats.margins_at(flips) if m == m]
                add(label, shape, "topk_flip_max_margin", max(flip_m) if flip_m else float("nan"), "relative", **base)
                add(label, shape, "topk_min_relative_margin", dec.stats.min_margin(), "relative", **base)
                add(label, shape, "logits_scale", same_logits.abs().max(), "abs", **base)
                add(label, shape, "top1_agreement", top1, "fraction", **base)
                add(label, shape, "top1_agreement_vs_checkpoint", top1_ckpt, "fraction", **base)
                add(label, shape, "greedy_identical", toks == same_tokens, "bool", **base)
                add(label, shape, "greedy_identical_vs_checkpoint", toks == ref_tokens, "bool", **base)
                first_diff = next((i for i, (a, b) in enumerate(zip(toks, same_tokens)) if a != b), len(toks))
                add(label, shape, "greedy_first_divergence", first_diff, "token", **base)
                add(label, shape, "topk_selected_last", selected[-1] if selected else float("nan"), "slots", **base)
                add(label, shape, "context_last", context[-1] if context else float("nan"), "tokens", **base)
                add(label, shape, "wall_time", time.time() - t0, "s", **base)
                for pos in range(err.numel()):
                    add(label, f"{shape}_pos{pos}", "logits_max_abs_err_at_position", err[pos], "abs", **base)
                for pos in flips:   # positions whose DSA selection differs from transformers' (near-ties)
                    add(label, f"{shape}_pos{pos}", "topk_flip_at_position", err[pos], "abs", **base)
                log(f"  {qt} {label:28s} vs transformers on the GGUF weights: max err {float(err.max()):.3g}, "
                    f"top1 {float(top1):.3f}, greedy identical {toks == same_tokens}, {len(flips)} top-k flips | "
                    f"vs float32 checkpoint: max err {float(err_ckpt.max()):.3g}, greedy identical "
                    f"{toks == ref_tokens}, {len(flips_ckpt)} flips | top-k {selected[-1] if selected else '?'}/"
                    f"{context[-1] if context else '?'} ({time.time() - t0:.0f}s)")
            except Exception as exc:  # noqa: BLE001
                add(label, shape, "failed", float("nan"), f"{type(exc).__name__}: {str(exc)[:250]}", dtype=kvd, layout=qt)
                log(f"  {qt} {label}: FAILED {type(exc).__name__}: {exc}")

    # dense vs sparse: the same path with DSA off; the logits must move, or the top-k would be a no-op
    if not dense_check:
        return rows
    try:
        config = hf_config_from_gguf(paths.gguf(qtypes[0]))
        state = weights_from_gguf(paths.gguf(qtypes[0]))
        sparse = Glm5Decoder(config, state, attention="reference", indexer="reference", kv_dtype=torch.float32)
        dense = Glm5Decoder(config, state, attention="reference", indexer="reference", kv_dtype=torch.float32,
                            dense=True)
        ls, ld = sparse.forward(prompt), dense.forward(prompt)
        k = config.index_topk
        shape = f"tiny_{qtypes[0]}_prompt{P}"
        beyond = slice(k, None)   # positions whose context exceeds the top-k
        add("dense-vs-sparse", shape, "logits_max_abs_change", (ls - ld)[beyond].abs().max(), "abs", layout=qtypes[0])
        add("dense-vs-sparse", shape, "logits_max_abs_change_within_topk", (ls - ld)[:k].abs().max(), "abs",
            layout=qtypes[0])
        add("dense-vs-sparse", shape, "top1_agreement", (ls.argmax(-1) == ld.argmax(-1))[beyond].float().mean(),
            "fraction", layout=qtypes[0])
        with torch.no_grad():
            r = ref_model(prompt[None]).logits[0]
        add("dense-vs-sparse", shape, "dense_vs_transformers_sparse_max_abs_err", (ld - r).abs().max(), "abs",
            layout=qtypes[0])   # transformers runs DSA: how far turning it off moves from the sparse reference
        log(f"  dense vs sparse: max logits change {float((ls - ld)[beyond].abs().max()):.3g} beyond position {k}, "
            f"{float((ls - ld)[:k].abs().max()):.2g} within it")
    except Exception as exc:  # noqa: BLE001
        add("dense-vs-sparse", "tiny", "failed", float("nan"), f"{type(exc).__name__}: {str(exc)[:250]}")
        log(f"  dense vs sparse: FAILED {type(exc).__name__}: {exc}")
    return rows


def model_accuracy_table(df):
    """glm5lab decode path vs transformers, one row per (GGUF type, variant)."""
    import pandas as pd

    d = df[df.suite == SUITE_MODEL].copy()
    if d.empty:
        return pd.DataFrame()
    d["value"] = pd.to_numeric(d.value, errors="coerce")
    keep = ["logits_max_abs_err", "logits_max_abs_err_topk_agreeing", "topk_flip_positions", "topk_flip_max_margin",
            "topk_min_relative_margin", "top1_agreement",
            "greedy_identical", "logits_max_abs_err_vs_checkpoint", "topk_flip_positions_vs_checkpoint",
            "greedy_identical_vs_checkpoint",
            "greedy_first_divergence", "topk_selected_last", "context_last", "logits_max_abs_change",
            "logits_max_abs_change_within_topk"]
    d = d[d.metric.isin(keep)]
    return d.pivot_table(index=["layout", "implementation", "dtype"], columns="metric", values="value",
                         aggfunc="last")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
