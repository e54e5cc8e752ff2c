"""GLM-5 generating inside vLLM itself through glm5lab: one call for users, notebooks and tests.

`start_engine(model)` builds a `vllm.LLM` for a GLM-5-style (DSA) model -- the tiny one, an HF directory,
or a GGUF read through vllm-gguf-plugin + glm5lab's adapter -- after checking, with one clear line each,
the three reasons it would otherwise die with a worker traceback: glm5lab's vLLM plugin would not be
loaded, the installed vLLM is not the version glm5lab's patches were written for, or the model has no
`index_topk` (not a DSA model: glm5lab has nothing to add). `generate(engine, prompts)` decodes greedily
and reports which attention backend, which implementation path and which indexer vLLM actually ran.

`engine_wall(model)` starts vLLM on the same model WITHOUT glm5lab's plugin (in a subprocess, so the
caller's process stays clean) and returns vLLM's refusal as data: the seed story's wall, on any machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from glm5lab.errors import Glm5labError

PLUGIN_NAME = "glm5lab"
# Small engine for the tiny model on a CPU: short context, little KV memory, no CUDA graphs/compile.
DEFAULT_ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
                           enforce_eager=True, gpu_memory_utilization=0.2,
                           kv_cache_memory_bytes=64 << 20, seed=0)


@dataclasses.dataclass
class ModelSpec:
    """What vLLM is pointed at: model (HF dir or .gguf), tokenizer dir, the HF config it will use."""

    name: str
    model: str
    tokenizer: str | None
    gguf: bool
    hf_config: object


@dataclasses.dataclass
class Engine:
    llm: object
    spec: ModelSpec
    dtype: str
    start_seconds: float


@dataclasses.dataclass
class GenerationResult:
    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]
    texts: list[str | None]
    first_step_logprobs: list[dict[int, float]] | None   # token id -> log-prob at the first generated step
    attention_backend: str
    attention_path: str
    indexer: str
    mixed_batches: int     # forwards so far (engine lifetime) with decode and prefill tokens together
    model: str
    source: str            # "hf" or "gguf"
    dtype: str
    seconds: float
    model_class: str = "?"   # the vLLM model class the engine built (on CUDA: see glm5lab.vllm_plugin.dsa_model)

    def summary(self) -> str:
        return (f"vLLM used attention backend {self.attention_backend} ({self.attention_path}) and indexer "
                f"{self.indexer}; model {self.model} ({self.source}, {self.dtype}) as {self.model_class}")


# ------------------------------------------------------------------------------------------ preflight
def plugin_problem() -> str | None:
    """Why vLLM would not load glm5lab's plugin in its processes, or None."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    if PLUGIN_NAME not in names:
        return ("glm5lab's vLLM plugin is not installed (no 'glm5lab' entry point in vllm.general_plugins): "
                "install glm5lab into this environment (pip install -e .) so vLLM loads it")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):    # vLLM splits on "," and strips nothing
        if PLUGIN_NAME in [p.strip() for p in allowed.split(",")]:
            return (f"VLLM_PLUGINS={allowed!r}: vLLM does not strip the spaces around its names, so it reads "
                    f"no plugin named 'glm5lab'; write the list without spaces")
        return (f"VLLM_PLUGINS={allowed!r} excludes glm5lab's plugin: unset VLLM_PLUGINS or add 'glm5lab' "
                "to it")
    return None


def version_problem() -> str | None:
    """The first ledger patch this run needs that refuses the installed vLLM (one line), or None."""
    import importlib

    from glm5lab.vllm_plugin import cpu_sparse, ledger
    importlib.import_module("glm5lab.vllm_plugin.sparse_backend")    # (its ledger entries register on import)

    needed = ["register TRITON_MLA_SPARSE"] + list(cpu_sparse.CPU_PATCHES)
    for name in needed:
        try:
            ledger.check_versions(ledger.LEDGER[name])
        except Glm5labError as exc:
            return str(exc)
    return None


def resolve_model(model: str = "tiny", gguf: bool = False, qtype: str = "F16",
                  tokenizer: str | None = None) -> ModelSpec:
    """'tiny' (glm5lab's tiny GLM-5; with gguf=True its GGUF of `qtype`), an HF directory, or a .gguf. The
    tokenizer: `tokenizer` (a folder vLLM reads it from) when given; else the HF directory, or the folder of a
    GGUF that has a tokenizer.json beside it; else None (token-id prompts only)."""
    given_tokenizer = tokenizer
    if model == "tiny":
        from glm5lab.model.tiny import ensure_tiny

        paths = ensure_tiny(qtypes=(qtype,) if gguf else ())
        target = paths.gguf(qtype) if gguf else paths.hf_dir
        tokenizer = str(paths.hf_dir)
    else:
        target = Path(model).expanduser()
        if not target.exists():
            raise Glm5labError(f"model path {target} does not exist")
        gguf = gguf or target.suffix == ".gguf"
        tokenizer = None if gguf else str(target)
        if gguf and (target.parent / "tokenizer.json").exists():
            tokenizer = str(target.parent)
    if given_tokenizer is not None:
        folder = Path(given_tokenizer).expanduser()
        if not folder.is_dir():
            raise Glm5labError(f"tokenizer {folder}: not a folder (give the folder holding tokenizer.json)")
        tokenizer = str(folder)
    if gguf:
        from glm5lab.gguf.reader import open_gguf
        from glm5lab.gguf.shards import require_loadable_tensors
        from glm5lab.vllm_plugin.gguf_loader import config_from_gguf

        s = open_gguf(target)                       # headers only, parsed once for all three
        config = config_from_gguf(s)
        require_loadable_tensors(s, config)         # refused here, not inside the engine
        if tokenizer is not None and (Path(tokenizer) / "config.json").is_file():
            # vllm-gguf-plugin builds the model from that config.json, not from the GGUF's metadata
            from glm5lab.gguf.config import require_same_geometry
            from glm5lab.model.checkpoint import read_hf_config

            require_same_geometry(config, read_hf_config(tokenizer), target.name, f"{tokenizer}/config.json")
    else:
        if not (target / "config.json").exists():
            raise Glm5labError(f"{target} has no config.json (pass a .gguf with --gguf, or an HF directory)")
        from glm5lab.model.checkpoint import read_hf_config

        config = read_hf_config(target)
    return ModelSpec(name=model, model=str(target), tokenizer=tokenizer, gguf=gguf, hf_config=config)


def model_problem(spec: ModelSpec) -> str | None:
    text = getattr(spec.hf_config, "get_text_config", lambda: spec.hf_config)()
    if getattr(text, "index_topk", None) is None:
        return (f"{spec.model} ({getattr(text, 'model_type', '?')}) has no index_topk: it is not a DSA "
                "sparse-attention model, so glm5lab's TRITON_MLA_SPARSE backend and indexer do not apply; "
                "run it with vLLM directly")
    from glm5lab.vllm_plugin.sparse_backend import geometry_problem

    return geometry_problem(text)


def preflight(spec: ModelSpec) -> None:
    for problem in (plugin_problem(), version_problem(), model_problem(spec)):
        if problem:
            raise Glm5labError(problem)


def hf_overrides_for(spec: ModelSpec) -> dict:
    """vLLM-only glm_moe_dsa config keys the checkpoint lacks (see glm5lab.vllm_plugin.gguf_loader):
    without them vLLM's DeepSeek code routes experts with softmax and no score bias and ropes the indexer
    in the wrong layout."""
    if getattr(spec.hf_config, "model_type", None) != "glm_moe_dsa" or spec.gguf:
        return {}  # the GGUF config parser patch fills them itself
    from glm5lab.vllm_plugin.gguf_loader import vllm_config_extras

    return {k: v for k, v in vllm_config_extras().items()
            if v is not None and getattr(spec.hf_config, k, None) is None}


# ------------------------------------------------------------------------------------------ engine
def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[-1] if text else type(exc).__name__


def start_engine(model: str = "tiny", *, gguf: bool = False, qtype: str = "F16", dtype: str = "float16",
                 tokenizer: str | None = None, **engine_args) -> Engine:
    """A vllm.LLM on `model` with glm5lab's plugin, in this process (V1 multiprocessing off: the CPU
    engine is small, and a failure is an exception here rather than a dead worker)."""
    return _start(resolve_model(model, gguf=gguf, qtype=qtype, tokenizer=tokenizer), dtype, **engine_args)


def _start(spec: ModelSpec, dtype: str, **engine_args) -> Engine:
    """start_engine on a resolved model."""
    preflight(spec)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")   # effective if vLLM is not imported yet
    from vllm import LLM

    # Asked for by name: on a GPU vLLM's own selector validates it (and would otherwise pick by its
    # priority list); on the CPU glm5lab's selection patch serves sparse layers with it either way.
    args = {**DEFAULT_ENGINE_ARGS, "attention_backend": "TRITON_MLA_SPARSE", **engine_args}
    overrides = hf_overrides_for(spec)
    if overrides:
        args["hf_overrides"] = {**overrides, **args.get("hf_overrides", {})}
    if spec.tokenizer is None:
        args.setdefault("skip_tokenizer_init", True)
    t0 = time.perf_counter()
    try:
        llm = LLM(model=spec.model, tokenizer=spec.tokenizer, dtype=dtype, max_logprobs=-1, **args)
    except Glm5labError:
        raise
    except Exception as exc:  # one line, not a worker traceback
        raise Glm5labError(f"vLLM could not start on {spec.model}: {_last_line(exc)}") from exc
    return Engine(llm=llm, spec=spec, dtype=dtype, start_seconds=time.perf_counter() - t0)


def _describe_worker(worker) -> dict:
    """Runs inside the vLLM worker: which model class, attention backend/impl path and indexer the model uses."""
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm.platforms import current_platform

    indexers = (Indexer,)
    if current_platform.is_cuda():   # vLLM's CUDA DSA model has an indexer module of its own (see dsa_model)
        from vllm.models.deepseek_v32.attention import DeepseekV32Indexer

        indexers += (DeepseekV32Indexer,)
    model = worker.model_runner.model
    backends, paths, mixed = set(), set(), 0
    indexer = "none"
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        impl = getattr(module, "impl", None)
        if backend is not None and getattr(backend, "is_mla", lambda: False)():
            backends.add(backend.get_name())
            if getattr(impl, "last_path", None):
                paths.add(impl.last_path)
            mixed = max(mixed, getattr(impl, "mixed_batches", 0))
        if isinstance(module, indexers):
            forward = type(module).forward
            if getattr(forward, "__module__", "").startswith("glm5lab"):
                from glm5lab.vllm_plugin.cpu_sparse import indexer_path

                indexer = indexer_path()
            else:
                op = type(getattr(module, "indexer_op", None))
                reason = getattr(module.indexer_op, "glm5lab_reason", None)
                indexer = f"{op.__module__}.{op.__name__}" + (" (glm5lab kernels)" if reason else "")
    return {"attention_backend": ",".join(sorted(backends)) or "?",
            "attention_path": ",".join(sorted(paths)) or "not run yet", "indexer": indexer,
            "mixed_batches": mixed, "model_class": f"{type(model).__module__}.{type(model).__qualname__}"}


def describe(engine: Engine) -> dict:
    return engine.llm.collective_rpc(_describe_worker)[0]


def tokenize(engine: Engine, prompt: str) -> list[int]:
    if engine.spec.tokenizer is None:
        raise Glm5labError(no_tokenizer(engine.spec))
    tok = engine.llm.get_tokenizer()
    return list(tok(prompt)["input_ids"])


def generate(engine: Engine, prompts, max_tokens: int | list[int] = 8, logprobs: bool = False) -> GenerationResult:
    """Greedy decoding of `prompts` (strings, or lists of token ids) submitted together; `max_tokens` may
    be one number per prompt (requests then finish at different steps, and a waiting prompt's prefill
    shares a forward with the others' decode tokens)."""
    from vllm import SamplingParams

    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ids = [p if isinstance(p, list) else tokenize(engine, p) for p in prompts]
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ids)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=-1 if logprobs else None,
                             detokenize=engine.spec.tokenizer is not None) for n in counts]
    t0 = time.perf_counter()
    try:
        outs = engine.llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    except Exception as exc:
        raise Glm5labError(f"vLLM generation failed: {_last_line(exc)}") from exc
    seconds = time.perf_counter() - t0
    first = None
    if logprobs:
        first = [{int(t): float(lp.logprob) for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    info = describe(engine)
    return GenerationResult(
        prompt_token_ids=ids, token_ids=[list(o.outputs[0].token_ids) for o in outs],
        texts=[o.outputs[0].text if engine.spec.tokenizer else None for o in outs], first_step_logprobs=first,
        attention_backend=info["attention_backend"], attention_path=info["attention_path"],
        indexer=info["indexer"], mixed_batches=info["mixed_batches"], model_class=info["model_class"],
        model=engine.spec.model, source="gguf" if engine.spec.gguf else "hf", dtype=engine.dtype, seconds=seconds)


def no_tokenizer(spec: ModelSpec) -> str:
    return (f"{spec.model}: no tokenizer to encode a text prompt (vLLM cannot build this model's tokenizer from "
            f"a GGUF, and no tokenizer.json lies beside it): pass the original model's folder as tokenizer "
            f"(--tokenizer DIR; from Python, tokenizer=DIR), or, from Python, prompts as lists of token ids")


def run(model: str = "tiny", prompts=("The model reads a prompt",), max_tokens: int = 8, *, gguf: bool = False,
        qtype: str = "F16", dtype: str = "float16", tokenizer: str | None = None) -> GenerationResult:
    """Start an engine and generate once (the `glm5lab generate` command and notebooks). Text prompts need a
    tokenizer: without one the call is refused before the engine starts."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    spec = resolve_model(model, gguf=gguf, qtype=qtype, tokenizer=tokenizer)
    if spec.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise Glm5labError(no_tokenizer(spec))
    return generate(_start(spec, dtype), prompts, max_tokens=max_tokens)


def try_run(*args, **kwargs) -> tuple[GenerationResult | None, str | None]:
    """`run`, for notebooks and reports: (result, None), or (None, the one-line reason) when vLLM is not
    installed here or refuses to start (papermill fails a run on any raised cell)."""
    try:
        return run(*args, **kwargs), None
    except ModuleNotFoundError as exc:
        return None, f"vLLM is not installed on this machine ({exc.name} missing): nothing to generate with"
    except Glm5labError as exc:
        return None, str(exc)


# ------------------------------------------------------------------------------------------ the wall
_WALL_SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
spec = json.loads(sys.argv[1])
result = {"started": False, "error_type": None, "error": None}
try:
    from vllm import LLM
    LLM(**spec)
    result["started"] = True
except BaseException as exc:
    result["error_type"] = type(exc).__name__
    lines = str(exc).strip().splitlines()
    result["error"] = lines[-1] if lines else ""
print("GLM5LAB_WALL " + json.dumps(result))
"""


def engine_wall(model: str = "tiny", *, gguf: bool = False, qtype: str = "F16", dtype: str = "float16",
                timeout: float = 300.0) -> dict:
    """Start vLLM on the model with glm5lab's plugin switched off (VLLM_PLUGINS lists every other
    plugin) in a fresh process; return {"started", "error_type", "error", "plugins", "seconds"}."""
    from importlib.metadata import entry_points

    spec = resolve_model(model, gguf=gguf, qtype=qtype)
    others = sorted({ep.name for ep in entry_points(group="vllm.general_plugins")} - {PLUGIN_NAME})
    args = {**DEFAULT_ENGINE_ARGS, "model": spec.model, "tokenizer": spec.tokenizer, "dtype": dtype}
    overrides = hf_overrides_for(spec)
    if overrides:
        args["hf_overrides"] = overrides
    env = {"VLLM_LOGGING_LEVEL": "WARNING", **os.environ,
           "VLLM_PLUGINS": ",".join(others) if others else "none"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _WALL_SCRIPT, json.dumps(args)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"started": False, "error_type": "Timeout", "error": f"no answer within {timeout:.0f} s",
                "plugins": others, "seconds": timeout}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GLM5LAB_WALL ")), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        result = {"started": False, "error_type": "ProcessDied", "error": tail}
    else:
        result = json.loads(line[len("GLM5LAB_WALL "):])
    result.update(plugins=others, seconds=round(time.perf_counter() - t0, 1))
    return result
