// fp32 accumulation of 16-byte vectors of the combine payload (BF16 or float) and the cast back.
#pragma once
#include <cuda_bf16.h>

namespace ep {

template <typename T>
struct Vec;
template <>
struct Vec<__nv_bfloat16> {
    static constexpr int kElems = 8;
    __device__ __forceinline__ static void add(float* acc, int4 v) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
        }
    }
    __device__ __forceinline__ static int4 pack(const float* acc) {
        int4 v;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
        return v;
    }
};
template <>
struct Vec<float> {
    static constexpr int kElems = 4;
    __device__ __forceinline__ static void add(float* acc, int4 v) {
        acc[0] += __int_as_float(v.x), acc[1] += __int_as_float(v.y);
        acc[2] += __int_as_float(v.z), acc[3] += __int_as_float(v.w);
    }
    __device__ __forceinline__ static int4 pack(const float* acc) {
        return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3]));
    }
};

}  // namespace ep
