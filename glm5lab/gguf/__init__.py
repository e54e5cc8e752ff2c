"""GGUF tools for GLM-5 (llama.cpp architecture `glm-dsa`): write, read back, inspect, split, merge
(notebook 01). Needs only the `gguf` package (+ transformers for configs): no vLLM here.

Public API (import from the submodule named):

  glm5lab.gguf.writer
    convert_hf_to_gguf(hf_dir, out_path, qtype="F16"|"BF16"|"F32"|"Q8_0", n_shards=1, progress=True)
        -> list[Path]          # HF checkpoint dir -> glm-dsa GGUF (or <stem>-0000k-of-0000N.gguf shards)
    write_gguf(hf_loaders, config, tokenizer_dir, out_path, qtype, n_shards, progress) -> list[Path]
    tensor_type(gguf_name, shape, qtype) -> GGMLQuantizationType   # llama.cpp's per-tensor type rule
    write_skeleton_gguf(config, out_path, qtype="Q4_K", nextn_layers=0) -> Path  # sparse, headers only
  glm5lab.gguf.reader
    open_gguf(path | [shard paths] | any shard) -> GgufSet   # validated; .paths .readers .meta(key)
        .arch_key("attention.kv_lora_rank") .tensor(gguf_name) .tensor_index; bad input -> Glm5labError
    read_hf_tensors(path_or_set, names=None) -> {HF checkpoint name: float32 ndarray}
        # dequantized; attn_k_b+attn_v_b joined back into kv_b_proj; ffn_*_exps unstacked into
        # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight (the real GLM-5 on-disk names)
    read_gguf_tensors(path_or_set, names=None) -> {GGUF name: float32 ndarray (numpy shape)}
    dequantize(reader_tensor) -> float32 ndarray
    hf_model_from_gguf(path_or_set, dtype=None) -> GlmMoeDsaForCausalLM  # config + dequantized weights:
        # the fair reference for an engine serving that GGUF (same quantized weights)
  glm5lab.gguf.config
    hf_config_from_gguf(path_or_set) -> transformers.GlmMoeDsaConfig
  glm5lab.gguf.names
    gguf_tensor_specs(Geometry.from_hf(config)) -> [(gguf_name, numpy_shape)], split_kv_b / join_kv_b,
    component_of(gguf_name), hf_to_gguf_simple / gguf_to_hf_simple
  glm5lab.gguf.tokenizer
    tokenizer_from_gguf(path_or_set) -> PreTrainedTokenizerFast   # transformers can't load glm-dsa GGUF
    write_hf_tokenizer(path_or_set, out_dir) -> Path               # tokenizers; same ids as the HF one
  glm5lab.gguf.shards
    validate_shard_set(paths) -> GgufSet, merge_shards(shards, out_path) -> Path,
    split_gguf(path, n_shards, out_path=None) -> list[Path]
  glm5lab.gguf.report    (tables/plot for notebook 01)
  glm5lab.gguf.inspect
    inspect_gguf(path_or_set) -> GgufReport (.header, .metadata, .tensors DataFrame, .by_component,
    .by_type, .hf_config), estimate_real_glm5(qtypes=("Q4_K", "Q8_0")) -> DataFrame (labeled estimate)
"""
