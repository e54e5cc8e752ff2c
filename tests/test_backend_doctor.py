"""The backend doctor: live verdicts of the installed vLLM locked against a per-version YAML, reason
kinds, CLI errors, and no exception escaping for odd inputs.

vLLM's imports take ~15 s; every test shares them through the module-scoped `bd` fixture."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5lab.errors import Glm5labError

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def bd():
    from glm5lab.vllm_plugin import backend_doctor

    backend_doctor.diagnose("12.0", "float16", model="glm-5")  # pay vLLM's import once
    return backend_doctor


def _live_static(row) -> set[str]:
    from glm5lab.vllm_plugin.backend_doctor import SEP

    return {x.replace(" (from source)", "") for x in row["static_reasons"].split(SEP) if x}


# ------------------------------------------------------------------------------- the locked facts
def test_expected_verdicts_hold_for_installed_vllm(bd):
    version = bd.vllm_version().split("+")[0]
    path = DATA / f"expected_verdicts_vllm-{version}.yaml"
    assert path.is_file(), (
        f"no locked verdicts for vLLM {version}: run `glm5lab doctor` cells of the newest "
        f"tests/data/expected_verdicts_vllm-*.yaml on this vLLM, review what changed, and write {path.name}")
    lock = yaml.safe_load(path.read_text())
    assert lock["vllm_version"] == version
    assert len(lock["cells"]) >= 10
    mismatches = []
    for cell in lock["cells"]:
        df = bd.diagnose(**cell["target"])
        where = f"{cell['note']} {cell['target']}"
        live_order = list(df[df["considered"]].sort_values("priority")["backend"])
        if live_order != cell["priority_order"]:
            mismatches.append(f"{where}: priority {live_order} != {cell['priority_order']}")
        if df.attrs["pick"]["backend"] != cell["pick"]:
            mismatches.append(f"{where}: pick {df.attrs['pick']['backend']} != {cell['pick']}")
        rows = df.set_index("backend")
        for name, expected in cell["backends"].items():
            row = rows.loc[name]
            live = "rejected" if row["verdict"] == bd.REJECTED else (
                "passes" if row["verdict"] in (bd.PASS, bd.PASS_NEEDS_LIBRARY) else row["verdict"])
            if live != expected["verdict"]:
                mismatches.append(f"{where}: {name} {live} != {expected['verdict']} ({row['static_reasons']})")
            missing = set(expected.get("static", [])) - _live_static(row)
            if missing:
                mismatches.append(f"{where}: {name} lost static reasons {sorted(missing)}")
    assert not mismatches, "vLLM's verdicts changed:\n" + "\n".join(mismatches)


def test_seed_cell_still_has_no_backend_and_bf16_is_the_fix(bd):
    """The seed's wall (SM120 + fp16 + sparse + qk_nope 192) stands in 0.32; the one-line advice
    finds the change that helps by asking vLLM again (bf16 -> FlashInfer's SM120 sparse backend)."""
    df = bd.diagnose("12.0", "float16", "auto", model="glm-5")
    assert df.attrs["pick"]["backend"] is None
    line = bd.advice(df)
    assert "\n" not in line
    assert line.startswith("No MLA backend")
    assert "--dtype bfloat16 -> FLASHINFER_MLA_SPARSE_SM120" in line


# ----------------------------------------------------------------------------------- reason kinds
def test_library_reasons_are_separate_from_static_ones(bd):
    df = bd.diagnose("12.0", "bfloat16", "auto", model="glm-5").set_index("backend")
    row = df.loc["FLASHINFER_MLA_SPARSE_SM120"]
    assert row["static_reasons"] == ""
    if importlib.util.find_spec("flashinfer") is None:  # this CPU machine
        assert row["verdict"] == bd.PASS_NEEDS_LIBRARY
        assert row["reason_kind"] == bd.KIND_LIBRARY
        assert "FlashInfer" in row["library_reasons"]
    else:
        assert row["verdict"] in (bd.PASS, bd.PASS_NEEDS_LIBRARY)
    assert df.loc["TRITON_MLA", "reason_kind"] == bd.KIND_STATIC
    assert df.loc["TRITON_MLA", "library_reasons"] == ""


def test_pass_b_unmasks_static_checks_hidden_behind_a_library_check(bd):
    """vLLM's SM120 sparse backend checks FlashInfer before index_topk; without FlashInfer, vLLM alone
    would only say 'requires FlashInfer'. The doctor still finds the tiny model's index_topk=32."""
    row = bd.diagnose("12.0", "bfloat16", model="tiny").set_index("backend").loc["FLASHINFER_MLA_SPARSE_SM120"]
    assert row["verdict"] == bd.REJECTED
    assert "index_topk=2048" in row["static_reasons"]


def test_unimportable_classes_get_static_facts_from_source(bd):
    df = bd.diagnose("9.0", "bfloat16", model="glm-5").set_index("backend")
    for name in ("FLASHINFER_MLA", "FLASH_ATTN_MLA"):
        row = df.loc[name]
        if "import failed here" in row["library_reasons"]:
            assert "sparse not supported (from source)" in row["static_reasons"]
        else:  # imported here (a GPU box): asked for real
            assert "sparse not supported" in row["static_reasons"]
        assert row["verdict"] == bd.REJECTED


def test_exception_kinds():
    from glm5lab.vllm_plugin.backend_doctor import KIND_LIBRARY, KIND_UNASKED, _classify_exception

    assert _classify_exception(ModuleNotFoundError("No module named 'flashinfer'")) == KIND_LIBRARY
    assert _classify_exception(OSError("libcudart.so: cannot open")) == KIND_LIBRARY
    assert _classify_exception(AssertionError("Torch not compiled with CUDA enabled")) == KIND_LIBRARY
    assert _classify_exception(RuntimeError("boom")) == KIND_UNASKED
    assert _classify_exception(AssertionError("Current vLLM config is not set")) == KIND_UNASKED


def test_reason_text_classification():
    from glm5lab.vllm_plugin.backend_doctor import (KIND_LIBRARY, KIND_STATIC, KIND_UNASKED,
                                                     classify_reason)

    assert classify_reason("compute capability not supported") == KIND_STATIC
    assert classify_reason("qk_nope_head_dim != 128") == KIND_STATIC
    assert classify_reason("vllm._flashmla_C is not available, likely was not compiled") == KIND_LIBRARY
    assert classify_reason("ImportError: No module named 'flashinfer'") == KIND_LIBRARY
    assert classify_reason("RuntimeError: could not evaluate") == KIND_UNASKED


class BrokenAsk:
    """A registered backend whose validate_configuration raises: 'could not be asked', not a crash."""

    @classmethod
    def validate_configuration(cls, **kw):
        raise RuntimeError("needs a live engine")


@pytest.fixture
def registered_test_backends(bd):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    names = {"GLM5LAB_TEST_BROKEN_ASK": f"{__name__}.BrokenAsk",
             "GLM5LAB_TEST_MISSING_LIB": "glm5lab_no_such_package.backend.Backend"}
    for name, path in names.items():
        register_backend(name, path)
    yield names
    for name in names:  # leave vLLM's registry as it was
        member = AttentionBackendEnum._member_map_.pop(name)
        AttentionBackendEnum._member_names_.remove(name)
        AttentionBackendEnum._value2member_map_.pop(member.value, None)
        type.__delattr__(AttentionBackendEnum, name)
        from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

        _ATTN_OVERRIDES.pop(member, None)


def test_out_of_tree_backends_are_listed_and_never_crash_the_table(bd, registered_test_backends):
    df = bd.diagnose("12.0", "float16", model="glm-5").set_index("backend")
    broken = df.loc["GLM5LAB_TEST_BROKEN_ASK"]
    assert broken["verdict"] == bd.UNKNOWN and "needs a live engine" in broken["unasked_reasons"]
    assert not broken["considered"] and broken["source"] == __name__.split(".")[0]
    missing = df.loc["GLM5LAB_TEST_MISSING_LIB"]
    assert missing["reason_kind"] in (bd.KIND_LIBRARY, bd.KIND_UNASKED)
    assert "glm5lab_no_such_package" in missing["library_reasons"] + missing["unasked_reasons"]
    assert df.attrs["pick"]["backend"] is None  # neither is in vLLM's priority list


def test_glm5lab_column_is_absent_unless_registered(bd):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    df = bd.diagnose("12.0", "float16", model="glm-5")
    assert ("TRITON_MLA_SPARSE" in set(df["backend"])) == ("TRITON_MLA_SPARSE" in AttentionBackendEnum.__members__)
    with_ours = bd.diagnose("12.0", "float16", model="glm-5", include_glm5lab=True)
    if with_ours.attrs["plugin_note"] is None and "TRITON_MLA_SPARSE" in set(with_ours["backend"]):
        row = with_ours.set_index("backend").loc["TRITON_MLA_SPARSE"]
        assert row["source"] == "glm5lab" and row["considered"]
        assert row["priority"] == with_ours["priority"].max()       # last: the plugin's CUDA fallback
        if row["verdict"] in (bd.PASS, bd.PASS_NEEDS_LIBRARY):
            assert bd.advice(with_ours) == "vLLM 0.32.0 would pick TRITON_MLA_SPARSE."
        # without include_glm5lab: vLLM's own order, the registered backend selectable by name only
        plain = bd.diagnose("12.0", "float16", model="glm-5").set_index("backend")
        assert not plain.loc["TRITON_MLA_SPARSE", "considered"]
        assert "--attention-backend TRITON_MLA_SPARSE" in bd.advice(bd.diagnose("12.0", "float16", model="glm-5"))
    else:  # registration failed or did not add the backend: the doctor says so and fakes nothing
        assert "TRITON_MLA_SPARSE" not in set(with_ours["backend"]) or with_ours.attrs["plugin_note"]


@pytest.mark.parametrize("cap, dtype, kv", [("12.0", "float16", "auto"), ("8.6", "bfloat16", "fp8_ds_mla"),
                                            ("9.0", "bfloat16", "auto"), ("12.0", "bfloat16", "auto")])
def test_doctor_with_glm5lab_picks_what_vllm_picks_with_the_plugin_on_cuda(bd, cap, dtype, kv):
    """--with-glm5lab models a CUDA host where the plugin also made TRITON_MLA_SPARSE vLLM's last resort: its
    pick is the real selector's, asked with that patch applied to vLLM's CUDA platform. A backend whose library
    this CPU host lacks can be the doctor's pick; the selector here skips it (its import fails), and neither picks
    glm5lab's backend."""
    import importlib

    import torch

    from glm5lab.vllm_plugin import sparse_backend as sb
    from glm5lab.vllm_plugin.backend_enum import BACKEND_NAME, BACKEND_PATH

    df = bd.diagnose(cap, dtype, kv, model="glm-5", include_glm5lab=True)
    assert df.attrs["plugin_note"] is None
    sb.cuda_platform_for(cap)
    cuda = importlib.import_module("vllm.platforms.cuda")
    original = cuda._get_backend_priorities
    try:
        sb._apply_cuda_fallback(cuda)
        got = sb.select_backend(cap, dtype=getattr(torch, dtype), kv_cache_dtype=kv, requested=None)
    finally:
        cuda._get_backend_priorities = original
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    pick = df.attrs["pick"]
    assert got["reason"] is None, got
    if not pick["needs"]:
        assert pick["backend"] == BACKEND_NAME and got["path"] == BACKEND_PATH, (pick, got)
    else:   # vLLM's own backend keeps priority; here, lacking its library, the selector takes a later passing one
        assert pick["backend"] != BACKEND_NAME
        rows = df.set_index("backend")
        chosen = next(n for n in rows.index if AttentionBackendEnum[n].get_path() == got["path"])
        assert rows.loc[chosen, "verdict"] in (bd.PASS, bd.PASS_NEEDS_LIBRARY)
        assert rows.loc[chosen, "priority"] > rows.loc[pick["backend"], "priority"]


def test_other_platform_backends_are_marked_not_passing(bd):
    df = bd.diagnose("9.0", "bfloat16", model="glm-5", scope="all")
    others = df[df["backend"].str.startswith(("ROCM_", "XPU_", "CPU_", "AMX_"))]
    assert len(others) >= 3
    assert set(others["verdict"]) == {bd.NOT_CONSIDERED}
    assert set(others["reason_kind"]) == {bd.KIND_PLATFORM}
    assert not others["considered"].any()


# --------------------------------------------------------------------------------- model inputs
def test_model_from_hf_directory_and_bad_paths(bd, tmp_path):
    from glm5lab.model.tiny import tiny_config

    tiny_config().save_pretrained(tmp_path / "tiny")
    df = bd.diagnose("12.0", "bfloat16", model=str(tmp_path / "tiny"))
    assert df.attrs["target"]["index_topk"] == tiny_config().index_topk
    with pytest.raises(Glm5labError, match="no config.json"):
        bd.diagnose("12.0", model=str(tmp_path))
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path / "llama")
    with pytest.raises(Glm5labError, match="no MLA attention"):
        bd.diagnose("12.0", model=str(tmp_path / "llama"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(Glm5labError, match="cannot read it"):
        bd.diagnose("12.0", model=str(tmp_path / "bad"))


def test_model_from_gguf(bd, tiny_paths):
    """A GGUF is read through glm5lab.gguf.config (metadata only) into the HF config vLLM would see."""
    from glm5lab.model.tiny import tiny_config

    t = bd.diagnose("12.0", "bfloat16", model=str(tiny_paths.gguf("Q8_0"))).attrs["target"]
    want = tiny_config()
    assert (t["qk_nope_head_dim"], t["kv_lora_rank"], t["index_topk"], t["sparse"]) == (
        want.qk_nope_head_dim, want.kv_lora_rank, want.index_topk, True)


def test_deepseek_v32_geometry(bd):
    t = bd.diagnose("10.0", model="deepseek-v3.2").attrs["target"]
    assert (t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["kv_lora_rank"], t["index_topk"]) == (128, 64, 512, 2048)
    assert t["sparse"] is True


# -------------------------------------------------------------------------------- no exceptions
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.sampled_from(["1.0", "7.5", "8.0", "9.0", "10.3", "11.0", "12.1", "15.9"]),
       dtype=st.sampled_from(["float16", "bf16", "float32"]),
       kv=st.sampled_from(["auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla", "bfloat16"]),
       block=st.sampled_from([None, 1, 16, 63, 64, 128, 1 << 20]),
       sparse=st.sampled_from([None, True, False]),
       tp=st.sampled_from([1, 2, 4]),  # divide every model's heads (tiny 4, GLM-5 64, DeepSeek 128)
       model=st.sampled_from(["glm-5", "tiny", "deepseek-v3.2"]))
def test_no_exception_escapes_for_odd_targets(bd, cap, dtype, kv, block, sparse, tp, model):
    df = bd.diagnose(cap, dtype, kv, block, model=model, sparse=sparse, tensor_parallel_size=tp)
    assert len(df) >= 1
    assert set(df["verdict"]) <= {bd.PASS, bd.PASS_NEEDS_LIBRARY, bd.REJECTED, bd.UNKNOWN, bd.NOT_CONSIDERED}
    line = bd.advice(df)
    assert line and "\n" not in line


@pytest.mark.parametrize("model, tp, heads", [("glm-5", 3, 64), ("glm-5", 128, 64), ("tiny", 8, 4)])
def test_tensor_parallel_size_must_divide_the_heads(bd, model, tp, heads):
    # vLLM refuses such a TP at start-up; the doctor used to floor heads / TP (21 or 1 "heads per GPU")
    with pytest.raises(Glm5labError, match=f"tensor parallel size {tp} does not divide the model's {heads}"):
        bd.diagnose("12.0", model=model, tensor_parallel_size=tp)
    assert bd.diagnose("12.0", model=model, tensor_parallel_size=heads).attrs["target"]["num_heads"] == 1


def test_odd_model_geometry_does_not_raise(bd):
    from transformers import GlmMoeDsaConfig

    odd = GlmMoeDsaConfig(qk_nope_head_dim=0, qk_rope_head_dim=0, kv_lora_rank=96, index_topk=3,
                          num_attention_heads=3)
    df = bd.diagnose("12.0", "float16", model=odd)
    assert df.attrs["target"]["kv_lora_rank"] == 96 and len(df) >= 2


@pytest.mark.parametrize("bad, match", [
    (dict(capability="twelve"), "unknown compute capability"),
    (dict(capability="12.10"), "unknown compute capability"),
    (dict(capability="99.0"), "unknown compute capability"),
    (dict(dtype="int8"), "unknown dtype"),
    (dict(kv_cache_dtype="fp4"), "unknown KV-cache dtype"),
    (dict(block_size=0), "block size must be positive"),
    (dict(model="no/such/dir"), "neither tiny"),
    (dict(scope="some"), "scope must be"),
])
def test_bad_input_is_one_line_glm5lab_error(bd, bad, match):
    kw = dict(capability="12.0", dtype="float16", model="glm-5") | bad
    with pytest.raises(Glm5labError, match=match) as info:
        bd.diagnose(**kw)
    assert "\n" not in str(info.value)


def test_capability_spellings():
    from glm5lab.vllm_plugin.backend_doctor import parse_capability

    for text, want in [("12.0", (12, 0)), ("12", (12, 0)), ("sm120", (12, 0)), ("sm_90", (9, 0)),
                       ("9.0a", (9, 0)), ("8.6", (8, 6)), ("SM100", (10, 0)), ((8, 9), (8, 9))]:
        assert parse_capability(text) == want, text


# ------------------------------------------------------------------------------------------- CLI
def test_cli_prints_table_and_one_line(bd, capsys):
    from glm5lab.cli import main

    assert main(["doctor", "--capability", "12.0", "--dtype", "float16", "--model", "tiny"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("target: SM120")
    assert any(line.lstrip().startswith("TRITON_MLA ") for line in out)
    assert out[-1].startswith(("No MLA backend", "vLLM "))


@pytest.mark.parametrize("argv, match", [
    (["--capability", "12.x"], "unknown compute capability '12.x'"),
    (["--model", "/no/such/model.gguf"], "neither tiny"),
    (["--dtype", "fp64"], "unknown dtype"),
    (["--matrix", "--capability", "9.0"], "--matrix spans every capability x dtype x KV-cache dtype"),
    (["--matrix", "--kv-cache-dtype", "auto", "--all"], "drop --kv-cache-dtype, --all"),
])
def test_cli_errors_are_one_line_exit_1(argv, match, capsys):
    from glm5lab.cli import main

    assert main(["doctor", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err and err.startswith("glm5lab doctor: error:")


# ------------------------------------------------------------------------- matrix, plot, seed
def test_matrix_cli_applies_every_cell_setting_and_names_its_files_by_them(bd, tmp_path, tiny_paths, capsys):
    """--sparse, --block-size and --tensor-parallel-size hold in every cell (they used to be dropped), the file
    names say so (a default matrix is not overwritten), and a model given as a path names the files by its stem."""
    from glm5lab.cli import main

    gguf = tiny_paths.gguf("F16")
    assert main(["doctor", "--matrix", "--model", str(gguf), "--sparse", "no", "--block-size", "16",
                 "--tensor-parallel-size", "2", "--results-dir", str(tmp_path)]) == 0
    ver = bd.vllm_version()
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    stem = f"doctor/backend_matrix_{gguf.stem}_sparse-no_block16_tp2_vllm-{ver}"
    assert files == [f"{stem}.csv", f"{stem}.png", f"{stem}_backends.csv"], files
    import pandas as pd

    cells = pd.read_csv(tmp_path / f"{stem}.csv", keep_default_na=False)
    assert len(cells) == 6 * 2 * 3 and not cells["pick"].str.contains("SPARSE").any()   # dense MLA in every cell
    assert cells["pick"].str.len().gt(0).any()
    capsys.readouterr()
    assert main(["doctor", "--matrix", "--tensor-parallel-size", "3", "--results-dir", str(tmp_path)]) == 1
    assert "tensor parallel size 3 does not divide the model's 64 attention heads" in capsys.readouterr().err


def test_matrix_results_dir_that_is_a_file_is_refused_before_the_matrix_runs(bd, tmp_path, monkeypatch):
    """It used to fail at its first write (NotADirectoryError), after computing every cell."""
    a_file = tmp_path / "results"
    a_file.write_text("x")
    monkeypatch.setattr(bd, "matrix", lambda **kw: pytest.fail("the matrix ran"))
    with pytest.raises(Glm5labError, match=f"{a_file}: is a file; the results folder must be a folder"):
        bd.write_matrix_results(a_file, progress=False)


def test_matrix_files_carry_the_vllm_version(bd, tmp_path):
    out = bd.write_matrix_results(tmp_path, progress=False)
    ver = bd.vllm_version()
    cells = out["cells"]
    assert len(cells) == 6 * 2 * 3
    for key in ("cells_csv", "long_csv", "png"):
        assert ver in out[key].name and out[key].stat().st_size > 1000
    assert not list(tmp_path.rglob("*.tmp*"))
    assert set(cells["prov_vllm"]) == {ver}
    on = cells.set_index(["capability", "dtype", "kv_cache_dtype"])
    assert on.loc[("12.0", "float16", "auto"), "pick"] == ""  # automatic pick; explicit-only is separate
    assert on.loc[("12.0", "float16", "auto"), "status"] in ("none", "explicit only")
    assert on.loc[("12.0", "bfloat16", "auto"), "pick"] == "FLASHINFER_MLA_SPARSE_SM120"
    assert set(cells[cells["capability"] == "8.0"]["pick"]) == {""}  # nothing sparse on Ampere in vLLM
    assert ver in out["figure"].axes[0].get_title()


def test_seed_table_is_data_with_provenance(bd):
    seed = bd.load_seed_table()
    assert set(seed["vllm_version"]) == {bd.SEED_VLLM_VERSION}
    assert {"FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA_SPARSE"} <= set(seed["backend"])
    assert (seed["source"].str.contains("shared/seeds/")).all()
    assert set(seed["capability"].astype(str)) == {"12.0"}
    cmp = bd.compare_with_seed().set_index("backend")
    assert cmp.loc["TRITON_MLA", "change"] == "still fails, same reasons"
    assert cmp.loc["FLASHINFER_MLA_SPARSE_SM120", "change"].startswith("new since the seed")
    assert "fixed: qk_nope_head_dim != 128" in cmp.loc["FLASHINFER_MLA", "change"]


def test_the_vllm_wings_failure_cells_hold_one_line(monkeypatch):
    """A library error whose reason sits on its second line (transformers' style) reaches a table cell as one line
    with that reason, in every wing that reports failures as data: loader check, the doctor's registration, vLLM's
    decode on a virtual block table."""
    import torch

    from glm5lab.vllm_plugin import loader_check, triton_decode_vbt
    from glm5lab.vllm_plugin import backend_doctor as doctor

    def fail(*args, **kwargs):
        raise ValueError("head_dim:\n  expected int, got str\n  (traceback detail)")

    expected = "ValueError: head_dim: expected int, got str"
    assert loader_check.safely(fail) == (None, expected)
    monkeypatch.setattr("glm5lab.vllm_plugin.register", fail)
    assert doctor.register_glm5lab() == f"glm5lab plugin registration failed: {expected}"
    monkeypatch.setattr(triton_decode_vbt, "vllm_triton_decode_status", lambda: {"available": True, "reason": ""})
    monkeypatch.setattr(triton_decode_vbt, "vllm_decode_attention_on_vbt", fail)
    kv = torch.randn(2, 4, 8)
    got = triton_decode_vbt.compare_vllm_decode_with_reference(torch.randn(1, 2, 8), kv, torch.tensor([[0, 3]]),
                                                               0.5, kv_lora_rank=6)
    assert got == {"status": "failed", "reason": expected}
