"""How loud vLLM is in a notebook. Its CPU worker logs ~40 WARNING lines a run (LD_PRELOAD, thread binding, kernels
registered twice, dtype casts of GGUF parameters) that say nothing about GLM-5 and bury the lines a reader needs;
`set_vllm_log_level` sets vLLM's level for this process and the processes it starts, and mutes two Python warnings
of the same kind (tqdm's missing notebook widget, torch's deprecation of an attribute vLLM's dispatcher probes).
Errors, and glm5lab's own lines, still show. Importing this module does not import vLLM."""
from __future__ import annotations

import logging
import os
import warnings

from glm5lab.errors import Glm5labError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
QUIET_WARNINGS = (r"IProgress not found", r"`torch\.distributed\.reduce_op` is deprecated")


def set_vllm_log_level(level: str = "ERROR") -> str:
    """vLLM's log level from now on (VLLM_LOGGING_LEVEL for processes not started yet, the "vllm" logger for this
    one, whether vLLM is imported already or not); returns the level set."""
    name = str(level).upper()
    if name not in LEVELS:
        raise Glm5labError(f"vLLM log level must be one of {', '.join(LEVELS)}, got {level!r}")
    os.environ["VLLM_LOGGING_LEVEL"] = name
    logging.getLogger("vllm").setLevel(name)
    if logging.getLevelName(name) > logging.WARNING:
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
    return name
