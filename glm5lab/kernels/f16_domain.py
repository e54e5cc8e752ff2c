"""Running fp8 (e4m3) data through fp16 tensor-core products: e4m3 -> fp16 is one conversion per two values, e4m3 ->
bf16 adds an F2F per value on Hopper, so a kernel with a bf16 q takes its fp8 products in fp16 instead, with q scaled
per row by a power of two into fp16's range (exact) and the inverse applied after the product. Shared by the sparse
MLA kernel ("f16" paths) and the indexer's logits kernel."""
import triton
import triton.language as tl


@triton.jit
def pow2_into_f16_range(amax):
    """Per row, the power of two m with amax * m in [2^14, 2^15): x * m is then exactly representable in fp16 for
    every value above amax * 2^-28 (smaller ones round as fp16 subnormals -- far below the fp32 accumulation error
    of a dot). Built from the exponent bits, so m is exact."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.minimum(tl.maximum(14 - e, -126), 127)
    m = ((k + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, m, 1.0)


@triton.jit
def e4m3_bits_to_f16_times_2e_8(x):
    """float8 e4m3fn bytes -> fp16 without hardware fp8 (SM80/86, ROCm, the interpreter): the sign and the 7
    exponent+mantissa bits s.eeee.mmm moved into the fp16 pattern s.0eeee.mmm0000000, which is the value times 2^-8
    exactly (exponent bias 7 against 15; subnormals onto subnormals). The caller puts the 2^8 back (into a scale)."""
    b = x.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
