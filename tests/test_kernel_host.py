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
