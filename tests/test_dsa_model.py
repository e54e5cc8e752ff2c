"""glm5lab.vllm_plugin.dsa_model: on CUDA, GLM-5 is built from vLLM's generic DSA model wherever glm5lab serves a part
of it (its indexer, or TRITON_MLA_SPARSE as the selector's pick), and from vLLM's CUDA model otherwise. The decision
and the registration run here against vLLM 0.32's own platform, selector and registry code, with the GPU faked; the
CUDA model itself only imports on a CUDA build of vLLM (none here, none on the lent GPUs)."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from glm5lab.vllm_plugin import dsa_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def fake_cuda(monkeypatch):
    """vLLM's current platform as CUDA with the capability asked for, and DeepGEMM present or not (tests/vllm_fakes)."""
    from tests.vllm_fakes import fake_cuda as make

    return lambda cap, deep_gemm=True: make(monkeypatch, cap, deep_gemm)


@pytest.mark.parametrize("cap, deep_gemm, picked, env, generic", [
    ((8, 9), True, "TRITON_MLA_SPARSE", None, "indexer"),             # SM8x: no MQA-logits kernels -> glm5lab's
    ((12, 0), False, "FLASHINFER_MLA_SPARSE_SM120", None, "indexer"),  # a CUDA vLLM without DeepGEMM
    ((12, 0), True, "TRITON_MLA_SPARSE", None, "TRITON_MLA_SPARSE"),   # SM120 fp16: vLLM's indexer, glm5lab's attention
    ((12, 0), True, "FLASHINFER_MLA_SPARSE_SM120", None, None),        # SM120 bf16: all vLLM's own
    ((9, 0), True, "FLASHMLA_SPARSE", None, None),                     # Hopper bf16: all vLLM's own
    ((9, 0), True, "FLASHMLA_SPARSE", "generic", "GLM5LAB_DSA_MODEL=generic"),
    ((8, 9), True, "TRITON_MLA_SPARSE", "vllm", None),
    ((12, 0), True, None, None, None)])                                # the selector picks none: vLLM's error stands
def test_the_generic_model_is_chosen_exactly_where_glm5lab_serves(fake_cuda, monkeypatch, cap, deep_gemm, picked,
                                                                   env, generic):
    fake_cuda(cap, deep_gemm)
    if env is None:
        monkeypatch.delenv(dsa_model.MODEL_ENV, raising=False)
    else:
        monkeypatch.setenv(dsa_model.MODEL_ENV, env)
    reason = dsa_model.generic_model_reason(object(), backend_name=lambda cfg: picked)
    assert (reason is None) == (generic is None), reason
    if generic is not None:
        assert generic in reason


def test_a_mistyped_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(dsa_model.MODEL_ENV, "generc")
    with pytest.raises(ValueError, match="GLM5LAB_DSA_MODEL='generc': expected one of auto, generic, vllm"):
        dsa_model.model_choice()


def test_the_selector_is_asked_what_the_mla_layers_will_ask(monkeypatch):
    """The dry run asks vLLM's get_attn_backend for the MLA layers' latent head (kv_lora_rank + rope), the model's
    dtype, the cache dtype, sparse, and the heads of one tensor-parallel rank; a selector that finds none gives None."""
    asked = []

    def selector(head_size, dtype, kv_cache_dtype, **kw):
        asked.append((head_size, dtype, kv_cache_dtype, kw))
        if kv_cache_dtype == "fp8":
            raise ValueError("Invalid attention backend for cuda")
        return SimpleNamespace(get_name=lambda: "TRITON_MLA_SPARSE")

    monkeypatch.setattr("vllm.v1.attention.selector.get_attn_backend", selector)
    hf = SimpleNamespace(num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64)
    cfg = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.float16),
                          parallel_config=SimpleNamespace(tensor_parallel_size=8),
                          cache_config=SimpleNamespace(cache_dtype="auto"))
    assert dsa_model.selected_attention_backend(cfg) == "TRITON_MLA_SPARSE"
    assert asked == [(576, torch.float16, "auto", {"use_mla": True, "use_sparse": True, "num_heads": 8})]
    cfg.cache_config.cache_dtype = "fp8"
    assert dsa_model.selected_attention_backend(cfg) is None


def test_the_registered_class_builds_one_model_or_the_other_once():
    """The registered class is a subclass of vLLM's CUDA model (the registry reads its interfaces from it); building it
    returns a finished instance of the chosen class, constructed once."""
    built = []

    class VllmModel(torch.nn.Module):
        supports_pp = True

        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            built.append((type(self).__name__, prefix))

    class GenericModel(torch.nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            built.append((type(self).__name__, prefix))

    cls = dsa_model.dispatching_class(VllmModel, GenericModel, reason=lambda cfg: cfg.get("why"))
    assert issubclass(cls, VllmModel) and cls.supports_pp and cls.__name__ == "GlmMoeDsaForCausalLM"
    assert type(cls(vllm_config={"why": "glm5lab's indexer"}, prefix="m")) is GenericModel
    assert type(cls(vllm_config={}, prefix="n")) is VllmModel
    assert built == [("GenericModel", "m"), ("VllmModel", "n")]


def test_registered_on_cuda_only_and_resolved_through_vllms_registry(fake_cuda, monkeypatch):
    """On CUDA the plugin part points vLLM's registry entry for GlmMoeDsaForCausalLM at glm5lab's class; on CPU it
    leaves vLLM's entry alone. On a CPU build of vLLM, `vllm.models.deepseek_v32` already is the generic model, so the
    class glm5lab's module gives is that model itself."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM as generic

    from glm5lab.vllm_plugin import ledger

    monkeypatch.setattr(dsa_model, "_CLASS", None)
    assert dsa_model.GlmMoeDsaForCausalLM is generic       # (CPU build: the generic model is vLLM's own here)
    with pytest.raises(AttributeError):
        dsa_model.NoSuchModel
    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))
    monkeypatch.setattr(ledger, "APPLIED", set())
    before = ModelRegistry.models[dsa_model.ARCH]
    dsa_model.register()                                   # this machine: vLLM's CPU platform
    assert ModelRegistry.models[dsa_model.ARCH] is before and dsa_model.PATCH_NAME not in ledger.APPLIED
    fake_cuda((8, 9))
    dsa_model.register()
    entry = ModelRegistry.models[dsa_model.ARCH]
    assert (entry.module_name, entry.class_name) == ("glm5lab.vllm_plugin.dsa_model", "GlmMoeDsaForCausalLM")
    assert dsa_model.PATCH_NAME in ledger.APPLIED


_REGISTRY_PROBE = """
import dataclasses, json
import vllm.model_executor.models.deepseek_v2   # (the CUDA-only kernels' modules are not importable here: the
import pytest                                  #  generic model's layers are imported under the CPU platform first)
from tests.vllm_fakes import fake_cuda

fake_cuda(pytest.MonkeyPatch(), (8, 9))          # for the rest of this process
from vllm.model_executor.models.registry import _ModelInfo
from vllm.models.deepseek_v32.nvidia.model import DeepseekV32ForCausalLM
from glm5lab.vllm_plugin import dsa_model

cls = dsa_model.GlmMoeDsaForCausalLM
ours, theirs = _ModelInfo.from_model_cls(cls), _ModelInfo.from_model_cls(DeepseekV32ForCausalLM)
print(json.dumps({"base": cls.__mro__[1].__module__ + "." + cls.__mro__[1].__qualname__, "name": cls.__qualname__,
                  "differ": sorted(f.name for f in dataclasses.fields(ours)
                                   if getattr(ours, f.name) != getattr(theirs, f.name))}))
"""


def test_vllms_registry_reads_the_cuda_models_interfaces_from_glm5labs_class():
    """In a process where vLLM believes it is on CUDA, glm5lab's class subclasses vLLM's CUDA DSA model, and vLLM's
    registry reads from it the same model info (pipeline / LoRA / MoE / quantization support...) as from vLLM's own
    class, all but the architecture's name. (A subprocess: importing vLLM's CUDA model replaces the process's
    `vllm.models.deepseek_v32`.)"""
    import json
    import subprocess
    import sys

    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])      # (tests.vllm_fakes is imported from there)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"base": "vllm.models.deepseek_v32.nvidia.model.DeepseekV32ForCausalLM",
                   "name": "GlmMoeDsaForCausalLM", "differ": ["architecture"]}
