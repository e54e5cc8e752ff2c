"""The offline GPU build several test files read (not a test module): scripts/sass_report.py and the scripts
around it run in their own process, with the Triton interpreter off there (a real build for sm_90 on this CPU
machine, Triton's bundled ptxas) while the rest of the suite keeps it on."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SASS_REPORT = ROOT / "scripts" / "sass_report.py"


def build_env() -> dict:
    """This process's environment without TRITON_INTERPRET, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def sass_report_cmd(*configs: dict, sm: int = 90) -> list:
    """The command line of scripts/sass_report.py for these --config objects (JSON report lines)."""
    cmd = [sys.executable, str(SASS_REPORT), "--sm", str(sm), "--json"]
    for c in configs:
        cmd += ["--config", json.dumps(c)]
    return cmd


def run_offline(cmd: list, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a command in the build environment (`build_env`), output captured."""
    return subprocess.run(cmd, capture_output=True, text=True, env=build_env(), timeout=timeout)


def sass_report(*configs: dict, sm: int = 90, dump: str | None = None, ok: bool = True) -> list:
    """sass_report.py's JSON lines for these configurations (one a configuration); dump: its --dump folder; ok:
    assert that the script exited 0 (a configuration it refuses is a line with "error", the exit still 0 or not)."""
    done = run_offline(sass_report_cmd(*configs, sm=sm) + (["--dump", dump] if dump else []))
    if ok:
        assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
