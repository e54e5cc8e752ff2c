"""scripts/ptx_variant.py, offline: its PTX edits on the persistent 8-head fp8_ds_mla tile's real build (Triton's
bundled ptxas, sm_90a) and the dump -> edit -> override round trip through Triton's compiler, which its GPU timings
would rest on (an override that silently did not apply would time the unedited kernel)."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests import offline_build

ROOT = Path(__file__).resolve().parents[1]
# the 8-head persistent tile, three products in flight (the default at >= 67 tokens of <= 8 heads in v20-v35)
CONFIG = {"gluon": True, "rows": True, "dual": True, "BLOCK_H": 8, "BLOCK_N": 64, "STAGES": 4, "SPLIT": False,
          "PIPE": 15, "num_warps": 4}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sass_report_cmd() -> list:
    return offline_build.sass_report_cmd(CONFIG)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("build")
    done = offline_build.run_offline(_sass_report_cmd() + ["--dump", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    return (out / "config0" / "ptx.txt").read_text()


@pytest.fixture(scope="module")
def pv():
    return _script("ptx_variant")


def _sass(pv, text: str) -> str:
    """The instructions of PTX text's sm_90a build, addresses and encodings dropped."""
    sass, _ = pv.build_sass(text)
    return "\n".join(re.sub(r"/\*.*?\*/", "", line).strip() for line in sass.splitlines()
                     if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))


def test_ignore_src_form_builds_the_same_sass(ptx, pv):
    """NOTES.md v32 Next asked whether cp.async's ignore-src predicate would change how ptxas places the gathers'
    zero-fill predicates (copies on P0 read the ideal shared wavefronts, the others 2.6x): it builds the very same
    SASS, so the mask's PTX form is not a lever."""
    edited = pv.ignore_src(ptx)
    assert edited.count("not.pred") == 22 and "0x10, %pzs" in edited       # every copy of a step, in the new form
    assert _sass(pv, edited) == _sass(pv, ptx)


def test_prefetch_hint_reaches_every_16_byte_gather(ptx, pv):
    """l2_256 puts .L2::256B on the 16-byte copies (latent and rope: LDGSTS.E.BYPASS.LTC256B.128) and leaves the
    scales' 4-byte ones (cp.async.ca) and every other instruction as built."""
    base, hinted = _sass(pv, ptx), _sass(pv, pv.EDITS["l2_256"](ptx))
    assert base.count("LDGSTS.E.BYPASS.128") == 20 and "LTC256B" not in base
    assert hinted.count("LDGSTS.E.BYPASS.LTC256B.128") == 20 and hinted.count("LDGSTS.E ") == 2
    assert hinted.replace(".LTC256B", "") == base


def test_edits_name_what_they_did_not_find(pv):
    with pytest.raises(ValueError, match="no masked cp.async"):
        pv.ignore_src(".reg .b32 %r<2>;\n")
    with pytest.raises(ValueError, match="no cp.async.cg"):
        pv.EDITS["l2_256"](".reg .b32 %r<2>;\n")


def test_override_round_trip_builds_the_edited_kernel(tmp_path):
    """The script's own flow with sass_report as the command ({edit} names each process's dump folder): the
    as-built process dumps the PTX, the edited one is what Triton builds in the second process."""
    done = offline_build.run_offline([sys.executable, str(ROOT / "scripts" / "ptx_variant.py"), "--work",
                                      str(tmp_path / "w"), "--edits", "l2_256", "--"] + _sass_report_cmd()
                                     + ["--dump", str(tmp_path / "{edit}")], timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Overriding kernel" in done.stdout
    base, edited = ((tmp_path / d / "config0" / "sass.txt").read_text() for d in ("base", "l2_256"))
    assert "LTC256B" not in base and edited.count("LDGSTS.E.BYPASS.LTC256B.128") == 20
    assert base.count("LDGSTS.E.BYPASS.128") == 20


def test_a_command_that_builds_no_kernel_is_named(tmp_path):
    """Nothing dumped (a command that compiles no Triton kernel, or one that found it in a cache): the script stops
    and says so instead of timing the unedited build as the edit."""
    done = offline_build.run_offline([sys.executable, str(ROOT / "scripts" / "ptx_variant.py"), "--work",
                                      str(tmp_path), "--edits", "l2_256", "--", sys.executable, "-c", "pass"],
                                     timeout=300)
    assert done.returncode != 0 and "built no Triton kernel" in done.stderr
