"""scripts/ptx_variant.py, offline: its PTX edits on the 8-head fp8_ds_mla default's real build (Triton's bundled
ptxas, sm_90a) and the dump -> edit -> override round trip through Triton's compiler, which the GPU timings rest on
(an override that silently did not apply would time the unedited kernel)."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the 8-head persistent tile, three products in flight (the default at >= 66 tokens of <= 8 heads)
CONFIG = {"gluon": True, "rows": True, "dual": True, "BLOCK_H": 8, "BLOCK_N": 64, "STAGES": 4, "SPLIT": False,
          "PIPE": 15, "num_warps": 4}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _sass_report_cmd() -> list:
    return [sys.executable, str(ROOT / "scripts" / "sass_report.py"), "--sm", "90", "--json", "--config",
            json.dumps(CONFIG)]


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("build")
    done = subprocess.run(_sass_report_cmd() + ["--dump", str(out)], capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return (out / "config0" / "ptx.txt").read_text()


@pytest.fixture(scope="module")
def pv():
    return _script("ptx_variant")


def _sass(pv, text: str, tmp_path: Path) -> str:
    src, cubin = tmp_path / "k.ptx", tmp_path / "k.cubin"
    src.write_text(text)
    subprocess.run([pv._tool("ptxas"), "-arch=sm_90a", "-O3", str(src), "-o", str(cubin)], check=True,
                   capture_output=True)
    sass = subprocess.run([pv._tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    return "\n".join(re.sub(r"/\*[0-9a-f]*\*/", "", line).strip() for line in sass.splitlines()
                     if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))


def test_ignore_src_form_builds_the_same_sass(ptx, pv, tmp_path):
    """NOTES.md v32 Next asked whether cp.async's ignore-src predicate would change how ptxas places the gathers'
    zero-fill predicates (copies on P0 read the ideal shared wavefronts, the others 2.6x): it builds the very same
    SASS, so the mask's PTX form is not a lever."""
    edited = pv.ignore_src(ptx)
    assert edited.count("not.pred") == 22 and "0x10, %pzs" in edited       # every copy of a step, in the new form
    assert _sass(pv, edited, tmp_path) == _sass(pv, ptx, tmp_path)


def test_alu_conversion_replaces_exactly_the_operand_conversions(ptx, pv, tmp_path):
    """alu_cvt rewrites the K and V operands' e4m3 -> fp16 conversions (256 a consumer, two consumers), alu_cvt_k
    only K's; ptxas takes both without a new spill."""
    before = pv.copies_summary(ptx)
    assert before["F2FP.F16.E4M3.UNPACK_B"] == 512
    both, k_only = pv.copies_summary(pv.EDITS["alu_cvt"](ptx)), pv.copies_summary(pv.EDITS["alu_cvt_k"](ptx))
    assert "F2FP.F16.E4M3.UNPACK_B" not in both and both["HMUL2"] == 512
    assert k_only["F2FP.F16.E4M3.UNPACK_B"] == 256 and k_only["HMUL2"] == 256
    assert both["STACK"] == k_only["STACK"] == before["STACK"]


def test_alu_conversion_is_exact_for_every_finite_byte():
    """The integer form's arithmetic (magnitude bits into fp16's place, sign to bit 15, x 256), on all 256 bytes
    against torch's e4m3: equal for every finite one; the two NaN bytes come out +-480."""
    import torch
    b = torch.arange(256, dtype=torch.int32)
    lanes = b << 8                                          # prmt 0x1404: the byte in the 16-bit lane's high half
    f16 = ((lanes & 0x7F00) >> 1) | (lanes & 0x8000)
    got = f16.to(torch.int16).view(torch.float16).float() * 256
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite]) and finite.sum() == 254
    assert got[~finite].abs().tolist() == [480.0, 480.0]


def test_edits_name_what_they_did_not_find(pv):
    with pytest.raises(ValueError, match="no masked cp.async"):
        pv.ignore_src(".reg .b32 %r<2>;\n")
    with pytest.raises(ValueError, match="no e4m3x2 conversion"):
        pv.EDITS["alu_cvt"](".reg .b32 %r<2>;\n")


def test_override_round_trip_builds_the_edited_kernel(tmp_path):
    """The script's own flow with sass_report as the command: the as-built process dumps the PTX, the edited one is
    what Triton builds in the second process (its report counts the edit's HMUL2 and no e4m3 conversion)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "ptx_variant.py"), "--work", str(tmp_path),
                           "--edits", "alu_cvt", "--"] + _sass_report_cmd(), capture_output=True, text=True,
                          env=_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line)["report"] for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2 and "Overriding kernel" in done.stdout
    assert reports[0]["F2FP"] == 560 and reports[0].get("HMUL2", 0) == 0
    assert reports[1]["F2FP"] == 560 - 512 and reports[1]["HMUL2"] == 512
