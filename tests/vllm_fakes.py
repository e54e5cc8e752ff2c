"""A CUDA GPU for vLLM's own platform code on a machine without one: tests of the plugin's CUDA decisions."""


def fake_cuda(monkeypatch, cap: tuple[int, int], deep_gemm: bool = True) -> None:
    """Make vLLM's current platform its own CudaPlatform (imported as the doctor imports it on a CPU build) with
    capability `cap`, and DeepGEMM present or not. monkeypatch undoes both."""
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability

    from glm5lab.vllm_plugin.backend_doctor import _cuda_platform_module

    cuda, why = _cuda_platform_module()
    assert cuda is not None, why

    class FakeCuda(cuda.CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(*cap)

    monkeypatch.setattr(vllm.platforms, "_current_platform", FakeCuda())
    monkeypatch.setattr("vllm.utils.import_utils.has_deep_gemm", lambda: deep_gemm)
