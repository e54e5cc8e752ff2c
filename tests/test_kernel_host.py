"""glm5lab.kernels.host: the plain-Python ceil-div and next power of two that replaced Triton's constexpr functions
on the kernels' host side must give Triton's values (they size grids, splits and padded tiles)."""
import triton

from glm5lab.kernels.host import cdiv, next_pow2


def test_cdiv_and_next_pow2_equal_tritons():
    for a in range(0, 700):
        for b in (1, 2, 3, 16, 32, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n)
    assert next_pow2(0) == 1 and next_pow2(2**31) == 2**31 and next_pow2(2**31 + 1) == 2**32


def test_the_device_is_asked_once_per_device(monkeypatch):
    """Every kernel call picks its paths by the capability and SM count; both are asked of torch once per device
    index (the current device for a bare "cuda"), and a CPU device has no capability query at all."""
    import torch

    from glm5lab.kernels import host

    asked = []
    monkeypatch.setattr(host, "_CAPABILITY", {})
    monkeypatch.setattr(host, "_SM_COUNT", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(("cap", i)) or (9, i))

    class Props:
        multi_processor_count = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(("sms", i)) or Props)
    for _ in range(3):
        assert host.cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert host.cuda_capability(torch.device("cuda")) == (9, 1)
        assert host.sm_count(torch.device("cuda:0")) == 132
    assert host.sm_count(torch.device("cpu")) == 8
    assert sorted(asked) == [("cap", 0), ("cap", 1), ("sms", 0)]
