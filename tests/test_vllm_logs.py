"""glm5lab.vllm_plugin.logs: the notebooks' knob for vLLM's log level (no vLLM needed)."""
import logging
import os
import warnings

import pytest

from glm5lab.errors import Glm5labError
from glm5lab.vllm_plugin.logs import set_vllm_log_level


@pytest.fixture
def restore_vllm_logging(monkeypatch):
    """vLLM's logger level, VLLM_LOGGING_LEVEL and the warning filters as they were before the test."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    logger = logging.getLogger("vllm")
    level = logger.level
    with warnings.catch_warnings():
        yield logger
    logger.setLevel(level)


def test_the_level_reaches_vllm_s_logger_its_children_and_processes_it_starts(restore_vllm_logging):
    seen = []
    handler = logging.Handler(logging.NOTSET)
    handler.emit = lambda record: seen.append(record.getMessage())
    restore_vllm_logging.addHandler(handler)         # (vLLM, once imported, stops its logger propagating to root)
    try:
        assert set_vllm_log_level("error") == "ERROR"
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
        child = logging.getLogger("vllm.v1.worker.cpu_worker")
        child.warning("libtcmalloc is not found in LD_PRELOAD")
        child.error("the engine failed")
        assert seen == ["the engine failed"]
        set_vllm_log_level("WARNING")
        child.warning("a warning again")
        assert seen == ["the engine failed", "a warning again"]
    finally:
        restore_vllm_logging.removeHandler(handler)


def test_quiet_levels_mute_only_the_two_known_python_warnings(restore_vllm_logging):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_vllm_log_level("ERROR")
        warnings.warn("IProgress not found. Please update jupyter and ipywidgets.")
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp`",
                      FutureWarning)
        warnings.warn("a cache was truncated")
    assert [str(w.message) for w in caught] == ["a cache was truncated"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_vllm_log_level("WARNING")                       # a loud level mutes nothing
        warnings.warn("IProgress not found. Please update jupyter and ipywidgets.")
    assert len(caught) == 1


def test_an_unknown_level_names_itself(restore_vllm_logging):
    with pytest.raises(Glm5labError, match="LOUD"):
        set_vllm_log_level("LOUD")
    assert "VLLM_LOGGING_LEVEL" not in os.environ
