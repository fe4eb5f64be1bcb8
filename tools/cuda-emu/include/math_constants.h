// CUDA's math_constants.h: float (…_F) and double constants by CUDA's names, as the correctly rounded values.
#pragma once
#include "emu_defs.h"
#include "emu_math.h"

#define CUDART_INF_F __int_as_float(0x7f800000)
#define CUDART_NAN_F __int_as_float(0x7fffffff)
#define CUDART_MIN_DENORM_F __int_as_float(0x00000001)
#define CUDART_MAX_NORMAL_F __int_as_float(0x7f7fffff)
#define CUDART_NEG_ZERO_F __int_as_float(int(0x80000000u))
#define CUDART_ZERO_F 0.0f
#define CUDART_ONE_F 1.0f
#define CUDART_SQRT_HALF_F float(M_SQRT1_2)
#define CUDART_SQRT_TWO_F float(M_SQRT2)
#define CUDART_THIRD_F float(1.0 / 3.0)
#define CUDART_PIO4_F float(M_PI_4)
#define CUDART_PIO2_F float(M_PI_2)
#define CUDART_3PIO4_F float(3 * M_PI_4)
#define CUDART_2_OVER_PI_F float(M_2_PI)
#define CUDART_SQRT_2_OVER_PI_F float(M_2_SQRTPI * M_SQRT1_2)
#define CUDART_PI_F float(M_PI)
#define CUDART_L2E_F float(M_LOG2E)
#define CUDART_L2T_F float(3.32192809488736234787)
#define CUDART_LG2_F float(0.30102999566398119521)
#define CUDART_LGE_F float(M_LOG10E)
#define CUDART_LN2_F float(M_LN2)
#define CUDART_LNT_F float(M_LN10)
#define CUDART_LNPI_F float(1.14472988584940017414)
#define CUDART_TWO_TO_M126_F 0x1p-126f
#define CUDART_TWO_TO_126_F 0x1p126f
#define CUDART_NORM_HUGE_F CUDART_MAX_NORMAL_F
#define CUDART_TWO_TO_23_F 0x1p23f
#define CUDART_TWO_TO_24_F 0x1p24f
#define CUDART_TWO_TO_31_F 0x1p31f
#define CUDART_TWO_TO_32_F 0x1p32f

#define CUDART_INF __longlong_as_double(0x7ff0000000000000ll)
#define CUDART_NAN __longlong_as_double((long long)0xfff8000000000000ull)
#define CUDART_NEG_ZERO __longlong_as_double((long long)0x8000000000000000ull)
#define CUDART_MIN_DENORM __longlong_as_double(1)
#define CUDART_ZERO 0.0
#define CUDART_ONE 1.0
#define CUDART_SQRT_TWO M_SQRT2
#define CUDART_SQRT_HALF M_SQRT1_2
#define CUDART_THIRD (1.0 / 3.0)
#define CUDART_TWOTHIRD (2.0 / 3.0)
#define CUDART_PIO4 M_PI_4
#define CUDART_PIO2 M_PI_2
#define CUDART_3PIO4 (3 * M_PI_4)
#define CUDART_2_OVER_PI M_2_PI
#define CUDART_PI M_PI
#define CUDART_SQRT_2PI 2.50662827463100050242
#define CUDART_SQRT_PIO2 1.25331413731550025121
#define CUDART_SQRT_2OPI 0.79788456080286535588
#define CUDART_L2E M_LOG2E
#define CUDART_L2T 3.32192809488736234787
#define CUDART_LG2 0.30102999566398119521
#define CUDART_LGE M_LOG10E
#define CUDART_LN2 M_LN2
#define CUDART_LNT M_LN10
#define CUDART_LNPI 1.14472988584940017414
#define CUDART_TWO_TO_52 0x1p52
#define CUDART_TWO_TO_53 0x1p53
#define CUDART_TWO_TO_54 0x1p54
