/* test_fp8.c — the FP8 numerics on their own (include/mok.h, FP8 section): the E4M3 conversion
 * against an independent decoding (every code; every bf16 input against a nearest-value search;
 * rounding at every boundary, ties to even), the scale rule, the NaN/Inf rules of a block,
 * mok_quantize_weights (layout, values, transposed copies, determinism), and the reference's FP8
 * function: checked against a straight-line computation of its own here, and its distance from
 * the bf16 function reported.
 *
 * The independent side: e4m3_value() decodes a code from its fields with ldexp, and
 * e4m3_nearest() finds a value's code by scanning every code's value; the scale rule is searched
 * by counting. None of it shares code with src/core/fp8.h or src/ref/. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fp8.h"
#include "core/fp8_weights.h"
#include "cpu/cpu.h"
#include "layer.h"
#include "mok.h"
#include "ref/ref.h"
#include "test.h"

/* ---- the independent side ------------------------------------------------------------------ */

static int is_nan_code(int code) { return (code & 0x7f) == 0x7f; }

/* The value of an E4M3 code from its fields: sign, 4 exponent bits (bias 7), 3 mantissa bits. */
static double e4m3_value(int code) {
    const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
    if (is_nan_code(code)) return NAN;
    const double magnitude = exponent == 0 ? ldexp(mantissa, -9) : ldexp(8 + mantissa, exponent - 10);
    return sign ? -magnitude : magnitude;
}

/* The code nearest to v by a scan of every finite code (ties to the even code, i.e. the even
 * mantissa); -1 when |v| is past the midpoint above 448 (no finite code is nearest). Zero keeps
 * v's sign. */
static int e4m3_nearest(double v) {
    const int sign = signbit(v) ? 0x80 : 0;
    const double a = fabs(v);
    if (a > 464.0) return -1;
    int best = 0;
    double best_err = INFINITY;
    for (int code = 0; code < 0x7f; ++code) {
        const double err = fabs(e4m3_value(code) - a);
        if (err < best_err || (err == best_err && (code & 1) == 0)) {
            best = code;
            best_err = err;
        }
    }
    return sign | best;
}

/* The smallest e >= -124 with amax <= 448 * 2^e (0 for amax 0), by counting down from above. */
static int scale_exponent(double amax) {
    if (amax == 0.0) return 0;
    int e = 130;
    while (e - 1 >= -124 && amax <= ldexp(448.0, e - 1)) --e;
    return e;
}

static float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint64_t rng_state;
static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rnd_uniform(void) { return (double)(rnd() >> 11) * 0x1.0p-52 - 1.0; } /* [-1, 1) */

/* ---- E4M3 ---------------------------------------------------------------------------------- */

MOK_TEST(fp8_e4m3_every_code) {
    int nans = 0;
    for (int code = 0; code < 256; ++code) {
        const float got = mok_e4m3_to_float((uint8_t)code), core = mok__e4m3_to_f32((uint8_t)code);
        const double want = e4m3_value(code);
        if (is_nan_code(code)) {
            ++nans;
            CHECK(isnan(got) && isnan(core), "code %#04x decodes to %g, not NaN", code, got);
            continue;
        }
        CHECK(got == want && !signbit(got) == !signbit(want) && memcmp(&got, &core, 4) == 0,
              "code %#04x decodes to %.9g, want %.9g", code, got, want);
        /* every finite code is its own value's code, -0 included */
        CHECK(mok_e4m3_from_float(got) == code, "code %#04x: its value %.9g encodes to %#04x", code, got,
              mok_e4m3_from_float(got));
    }
    CHECK(nans == 2, "%d NaN codes, the format has 2 (S.1111.111)", nans);
    CHECK(e4m3_value(0x7e) == 448.0 && e4m3_value(0x01) == 0x1p-9 && e4m3_value(0x08) == 0x1p-6,
          "the format's landmarks: max 448, smallest subnormal 2^-9, smallest normal 2^-6");
}

/* Every bf16 value (the quantizer's inputs are bf16 values scaled by a power of two) against the
 * nearest-code scan. */
MOK_TEST(fp8_e4m3_every_bf16_input) {
    int64_t bad = 0, nan_bad = 0, checked = 0;
    for (uint32_t b = 0; b < 65536; ++b) {
        const float v = bits_to_float(b << 16);
        const int got = mok_e4m3_from_float(v);
        if (isnan(v) || isinf(v) || fabs(v) > 464.0) {
            nan_bad += !is_nan_code(got) || (got & 0x80) != (signbit(v) ? 0x80 : 0);
            continue;
        }
        const int want = e4m3_nearest(v);
        ++checked;
        if (got != want && bad++ < 4)
            CHECK(0, "bf16 %#06x (%.9g) encodes to %#04x, the nearest code is %#04x", b, v, got, want);
    }
    CHECK(bad == 0, "%lld of %lld bf16 values encode to another code than the nearest", (long long)bad,
          (long long)checked);
    CHECK(nan_bad == 0, "%lld NaN, Inf or out-of-range bf16 values do not encode to the NaN code with their sign",
          (long long)nan_bad);
}

/* Each boundary between neighbouring codes: the midpoint goes to the even code, the fp32 values
 * just beside it to the nearer; so do the neighbours of every code's value. Both signs, from 0
 * (the ties 2^-10 -> 0, 3·2^-10 -> 2^-8) through the subnormal-normal step to 448 and past it
 * (464 ties down to 448, above it is NaN). */
MOK_TEST(fp8_e4m3_rounding_boundaries) {
    int64_t bad = 0;
    for (int sign = 0; sign < 2; ++sign)
        for (int code = 0; code < 0x7e; ++code) {
            const int lo = sign << 7 | code, hi = sign << 7 | (code + 1);
            const double a = e4m3_value(lo), b = e4m3_value(hi);
            const float mid = (float)((a + b) / 2); /* 5 significant bits: exact */
            const int even = (code & 1) == 0 ? lo : hi;
            const float toward_a = nextafterf(mid, (float)a), toward_b = nextafterf(mid, (float)b);
            const int got_mid = mok_e4m3_from_float(mid), got_a = mok_e4m3_from_float(toward_a),
                      got_b = mok_e4m3_from_float(toward_b);
            if ((got_mid != even || got_a != lo || got_b != hi) && bad++ < 4)
                CHECK(0,
                      "between %#04x (%g) and %#04x (%g): midpoint %.9g -> %#04x (want %#04x), %.9g -> %#04x, %.9g -> "
                      "%#04x",
                      lo, a, hi, b, mid, got_mid, even, toward_a, got_a, toward_b, got_b);
        }
    CHECK(bad == 0, "%lld boundaries round the wrong way", (long long)bad);
    CHECK(mok_e4m3_from_float(0x1p-10f) == 0x00 && mok_e4m3_from_float(-0x1p-10f) == 0x80, "2^-10 ties to zero");
    CHECK(mok_e4m3_from_float(nextafterf(0x1p-10f, 1.0f)) == 0x01, "just above 2^-10 rounds to 2^-9");
    CHECK(mok_e4m3_from_float(0x3p-10f) == 0x02, "3·2^-10 ties to the even 2^-8");
    CHECK(mok_e4m3_from_float(0xfp-10f) == 0x08, "7.5·2^-9 ties to the even 2^-6 (the smallest normal)");
    CHECK(mok_e4m3_from_float(464.0f) == 0x7e && mok_e4m3_from_float(-464.0f) == 0xfe, "464 ties down to 448");
    CHECK(mok_e4m3_from_float(nextafterf(464.0f, 1000.0f)) == 0x7f, "just above 464 is NaN (no infinity)");
    CHECK(mok_e4m3_from_float(1e30f) == 0x7f && mok_e4m3_from_float(-1e30f) == 0xff, "huge values are NaN");
    CHECK(mok_e4m3_from_float(INFINITY) == 0x7f && mok_e4m3_from_float(-INFINITY) == 0xff,
          "±Inf become the NaN code with their sign, never 448");
    CHECK(is_nan_code(mok_e4m3_from_float(NAN)), "NaN stays NaN");
    CHECK(mok_e4m3_from_float(1e-30f) == 0x00 && mok_e4m3_from_float(-1e-30f) == 0x80 &&
              mok_e4m3_from_float(bits_to_float(1u)) == 0x00,
          "tiny and fp32-subnormal values become zero with their sign");
    /* random fp32 values (not only bf16 ones) in the whole range, against the scan */
    rng_state = mok_test_seed() ^ 0xe4e3;
    int64_t random_bad = 0;
    for (int i = 0; i < 200000; ++i) {
        const float v = (float)ldexp(rnd_uniform(), (int)(rnd() % 24) - 14);
        const int got = mok_e4m3_from_float(v), want = e4m3_nearest(v);
        random_bad += want < 0 ? !is_nan_code(got) : got != want;
    }
    CHECK(random_bad == 0, "%lld random fp32 values encode to another code than the nearest (MOK_TEST_SEED=%llu)",
          (long long)random_bad, mok_test_seed());
}

/* ---- the scale rule ------------------------------------------------------------------------ */

MOK_TEST(fp8_scale_rule) {
    int64_t bad = 0;
    /* every positive finite bf16 amax, then random fp32 ones, then the landmarks */
    for (uint32_t b = 1; b < 0x7f80; ++b) {
        const float amax = bits_to_float(b << 16);
        const int e = mok__fp8_scale_exp(amax);
        if (e != scale_exponent(amax) && bad++ < 4)
            CHECK(0, "amax %.9g: scale 2^%d, want 2^%d", amax, e, scale_exponent(amax));
        /* amax / scale lands in (224, 448] unless the floor -124 holds the scale up */
        const double ratio = ldexp(amax, -e);
        if (!(ratio <= 448.0 && (ratio > 224.0 || e == -124)) && bad++ < 4)
            CHECK(0, "amax %.9g: amax / 2^%d = %g is not in (224, 448]", amax, e, ratio);
    }
    rng_state = mok_test_seed() ^ 0x5ca1e;
    for (int i = 0; i < 100000; ++i) {
        const float amax = (float)ldexp(fabs(rnd_uniform()) + 0x1p-30, (int)(rnd() % 240) - 120);
        bad += mok__fp8_scale_exp(amax) != scale_exponent(amax);
    }
    CHECK(bad == 0, "%lld amax values get another scale than the smallest power of two >= amax / 448", (long long)bad);
    CHECK(mok__fp8_scale_exp(0.0f) == 0, "amax 0: scale 1");
    CHECK(mok__fp8_scale_exp(448.0f) == 0 && mok__fp8_scale_exp(nextafterf(448.0f, 500.0f)) == 1,
          "448 fits scale 1, anything above needs 2");
    CHECK(mok__fp8_scale_exp(1.75f) == -8 && mok__fp8_scale_exp(nextafterf(1.75f, 2.0f)) == -7, "1.75 = 448 · 2^-8");
    CHECK(mok__fp8_scale_exp(bits_to_float(1u)) == -124 && mok__fp8_scale_exp(0x1p-120f) == -124,
          "tiny amax: the floor 2^-124");
    CHECK(mok__fp8_scale_exp(3.0e38f) == 120, "the largest amax needs 2^120");
    for (int e = -124; e <= 120; ++e)
        CHECK(mok__fp8_pow2(e) == (float)ldexp(1.0, e) && mok__fp8_pow2(-e) == (float)ldexp(1.0, -e),
              "2^%d is not exact", e);
    /* the floor keeps every dequantized value exact in bf16: the smallest subnormal at the floor */
    const float smallest = mok_e4m3_to_float(0x01) * mok__fp8_pow2(-124);
    CHECK(mok_bf16_to_float(mok_bf16_from_float(smallest)) == smallest && smallest == 0x1p-133f,
          "2^-9 · 2^-124 is not a bf16 value");
}

/* ---- a block with NaN and Inf ---------------------------------------------------------------- */

/* An activation block (the cpu tile's row quantizer) and a weight block (the weights' quantizer)
 * with NaN, +Inf, -Inf in them: those become NaN, the others and the scale are what they are
 * without them; a block of only non-finite values and zeros has scale 1. */
MOK_TEST(fp8_block_nan_inf_rules) {
    rng_state = mok_test_seed() ^ 0xb10c;
    enum { N = MOK_FP8_BLOCK };
    uint16_t clean[N], dirty[N];
    for (int i = 0; i < N; ++i) clean[i] = mok_bf16_from_float((float)(3.0 * rnd_uniform() + 0.01));
    const uint16_t bad_bits[3] = {0x7fc0, 0x7f80, 0xff80}; /* NaN, +Inf, -Inf */
    for (int k = 0; k < 3; ++k) {
        memcpy(dirty, clean, sizeof clean);
        const int at = (int)(rnd() % N);
        dirty[at] = bad_bits[k];
        /* activations: the cpu tile's row quantizer */
        float qc[N], qd[N], sc, sd;
        mok__cpu_rows_quantize(qc, &sc, clean, 1, N);
        mok__cpu_rows_quantize(qd, &sd, dirty, 1, N);
        CHECK(sc == sd, "case %d: the scale changed (%g -> %g) for a non-finite value", k, sc, sd);
        for (int i = 0; i < N; ++i) {
            if (i == at)
                CHECK(isnan(qd[i]), "case %d: the non-finite value became %g, not NaN", k, qd[i]);
            else
                CHECK(qd[i] == qc[i], "case %d: element %d changed (%g -> %g)", k, i, qc[i], qd[i]);
        }
        /* the clean block against this file's rule: s from its amax, q the nearest code of v / s */
        double amax = 0.0;
        for (int i = 0; i < N; ++i) amax = fmax(amax, fabs(mok_bf16_to_float(clean[i])));
        const int e = scale_exponent(amax);
        CHECK(sc == (float)ldexp(1.0, e), "case %d: scale %g, want 2^%d", k, sc, e);
        for (int i = 0; i < N; ++i)
            CHECK(qc[i] == e4m3_value(e4m3_nearest(ldexp(mok_bf16_to_float(clean[i]), -e))),
                  "case %d: element %d quantizes to %g", k, i, qc[i]);
    }
    /* a weight block of 128 x 128 with one NaN and one Inf */
    const int64_t R = MOK_FP8_BLOCK, C = MOK_FP8_BLOCK;
    uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(R * C));
    uint8_t *q = malloc((size_t)(R * C)), *qt = malloc((size_t)(R * C)), *q2 = malloc((size_t)(R * C)),
            *qt2 = malloc((size_t)(R * C));
    float s, st, s2, st2;
    for (int64_t i = 0; i < R * C; ++i) w[i] = mok_bf16_from_float((float)(0.05 * rnd_uniform() + 1e-4));
    mok__fp8_quantize_weight_block(w, R, C, 0, 0, q, qt, &s, &st);
    const int64_t nan_at = (int64_t)(rnd() % (uint64_t)(R * C)), inf_at = (nan_at + 77) % (R * C);
    w[nan_at] = 0x7fc0;
    w[inf_at] = 0xff80;
    mok__fp8_quantize_weight_block(w, R, C, 0, 0, q2, qt2, &s2, &st2);
    CHECK(s == s2 && st == st2 && s == st, "weight block: the scale changed (%g -> %g) for NaN and Inf", s, s2);
    int64_t changed = 0;
    for (int64_t i = 0; i < R * C; ++i) {
        if (i == nan_at || i == inf_at) {
            CHECK(is_nan_code(q2[i]) && is_nan_code(qt2[(i % C) * R + i / C]), "weight block: element %lld is not NaN",
                  (long long)i);
            continue;
        }
        changed += q[i] != q2[i] || qt2[(i % C) * R + i / C] != q2[i];
    }
    CHECK(changed == 0, "weight block: %lld finite elements changed beside a NaN and an Inf", (long long)changed);
    /* nothing finite but zeros: scale 1 */
    for (int64_t i = 0; i < R * C; ++i) w[i] = i % 3 ? 0x0000 : 0x7fc0;
    mok__fp8_quantize_weight_block(w, R, C, 0, 0, q2, qt2, &s2, &st2);
    CHECK(s2 == 1.0f && st2 == 1.0f, "a block of zeros and NaN has scale %g, want 1", s2);
    for (int64_t i = 0; i < R * C; ++i)
        CHECK(i % 3 ? q2[i] == 0x00 : is_nan_code(q2[i]), "zeros and NaN: element %lld is %#04x", (long long)i, q2[i]);
    free(w);
    free(q);
    free(qt);
    free(q2);
    free(qt2);
}

/* ---- mok_quantize_weights ------------------------------------------------------------------- */

static void *zalloc_aligned(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p) memset(p, 0, (bytes + 63) / 64 * 64);
    return p;
}

/* bf16 values uniform in ±1, every 128 x 128 block times its own power of two in [2^-20, 2^20]. */
static uint16_t *spread_weights(int64_t count, int64_t rows, int64_t cols) {
    uint16_t *w = zalloc_aligned((size_t)(count * rows * cols) * 2);
    for (int64_t m = 0; m < count; ++m)
        for (int64_t br = 0; br < rows / MOK_FP8_BLOCK; ++br)
            for (int64_t bc = 0; bc < cols / MOK_FP8_BLOCK; ++bc) {
                const int e = (int)(rnd() % 41) - 20;
                for (int64_t r = br * MOK_FP8_BLOCK; r < (br + 1) * MOK_FP8_BLOCK; ++r)
                    for (int64_t c = bc * MOK_FP8_BLOCK; c < (bc + 1) * MOK_FP8_BLOCK; ++c)
                        w[m * rows * cols + r * cols + c] = mok_bf16_from_float((float)ldexp(rnd_uniform(), e));
            }
    return w;
}

/* Matrix m of a layout: codes and scales against this file's rule (each block's scale from its
 * amax, each code the nearest of w / scale), and the transposed copy against the transpose. */
static int64_t check_matrix(const char *tag, const uint8_t *codes, const float *scales, const uint8_t *codes_t,
                            const float *scales_t, const uint16_t *w, int64_t count, int64_t rows, int64_t cols) {
    const int64_t br_n = rows / MOK_FP8_BLOCK, bc_n = cols / MOK_FP8_BLOCK;
    int64_t bad = 0;
    for (int64_t m = 0; m < count; ++m)
        for (int64_t br = 0; br < br_n; ++br)
            for (int64_t bc = 0; bc < bc_n; ++bc) {
                double amax = 0.0;
                for (int64_t r = br * MOK_FP8_BLOCK; r < (br + 1) * MOK_FP8_BLOCK; ++r)
                    for (int64_t c = bc * MOK_FP8_BLOCK; c < (bc + 1) * MOK_FP8_BLOCK; ++c)
                        amax = fmax(amax, fabs(mok_bf16_to_float(w[m * rows * cols + r * cols + c])));
                const int e = scale_exponent(amax);
                const float scale = scales[m * br_n * bc_n + br * bc_n + bc];
                const float scale_t = scales_t[m * br_n * bc_n + bc * br_n + br];
                if ((scale != (float)ldexp(1.0, e) || scale_t != scale) && bad++ < 3)
                    CHECK(0, "%s: matrix %lld block (%lld, %lld): scale %g, transposed %g, want 2^%d", tag,
                          (long long)m, (long long)br, (long long)bc, scale, scale_t, e);
                for (int64_t r = br * MOK_FP8_BLOCK; r < (br + 1) * MOK_FP8_BLOCK; ++r)
                    for (int64_t c = bc * MOK_FP8_BLOCK; c < (bc + 1) * MOK_FP8_BLOCK; ++c) {
                        const int want = e4m3_nearest(ldexp(mok_bf16_to_float(w[m * rows * cols + r * cols + c]), -e));
                        const uint8_t got = codes[m * rows * cols + r * cols + c];
                        const uint8_t got_t = codes_t[m * rows * cols + c * rows + r];
                        if ((got != want || got_t != got) && bad++ < 3)
                            CHECK(0, "%s: matrix %lld element (%lld, %lld): code %#04x, transposed %#04x, want %#04x",
                                  tag, (long long)m, (long long)r, (long long)c, got, got_t, want);
                    }
            }
    return bad;
}

MOK_TEST(fp8_quantize_weights_layout_and_determinism) {
    rng_state = mok_test_seed() ^ 0x9a17;
    enum { P = 2 };
    const mok_shape shape = {256, 128, 4, 2, 128, 8, MOK_PRECISION_FP8};
    const int64_t H = 256, I = 128, Is = 128, El = 2;
    mok_config config = MOK_CONFIG_INIT;
    config.cpu_threads = 2;
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    mok_status st = mok_group_create_local(&g, MOK_BACKEND_CPU, P, NULL, &config);
    if (st == MOK_OK) st = mok_workspace_create(&ws, g, &shape, &config);
    CHECK(st == MOK_OK, "FP8 workspace: %s", mok_last_error());
    mok_fp8_layout layout;
    if (st == MOK_OK) st = mok_workspace_fp8_layout(ws, &layout);
    CHECK(st == MOK_OK, "mok_workspace_fp8_layout: %s", mok_last_error());
    if (st != MOK_OK) {
        mok_workspace_destroy(ws);
        mok_group_destroy(g);
        return;
    }
    /* the layout: header first, then each matrix's codes and scales in enum order, 256-aligned,
       each region as large as its matrix */
    size_t end = 64; /* the header */
    for (int m = 0; m < MOK_FP8_NUM_MATRICES; ++m) {
        const int shared = m >= MOK_FP8_S_GATE, base = shared ? m - MOK_FP8_S_GATE : m;
        const int64_t inter = shared ? Is : I, count = shared ? 1 : El;
        const int64_t rows = (base == MOK_FP8_W_GATE || base == MOK_FP8_W_UP || base == MOK_FP8_W_DOWN_T) ? inter : H;
        const int64_t cols = rows == H ? inter : H;
        const size_t code_bytes = (size_t)(count * rows * cols),
                     scale_bytes = (size_t)(count * rows * cols) / 16384 * 4;
        CHECK(layout.codes[m] % 256 == 0 && layout.scales[m] % 256 == 0, "matrix %d: offsets not 256-aligned", m);
        CHECK(layout.codes[m] >= end && layout.scales[m] >= layout.codes[m] + code_bytes &&
                  layout.scales[m] + scale_bytes <= layout.bytes,
              "matrix %d: codes at %zu (%zu bytes), scales at %zu (%zu bytes) overlap or leave the %zu-byte buffer", m,
              layout.codes[m], code_bytes, layout.scales[m], scale_bytes, layout.bytes);
        end = layout.scales[m] + scale_bytes;
    }
    /* weights of two ranks and one shared expert, every block at its own scale */
    uint16_t *w[3][P], *s[3];
    for (int p = 0; p < P; ++p) {
        w[0][p] = spread_weights(El, I, H);
        w[1][p] = spread_weights(El, I, H);
        w[2][p] = spread_weights(El, H, I);
    }
    s[0] = spread_weights(1, Is, H);
    s[1] = spread_weights(1, Is, H);
    s[2] = spread_weights(1, H, Is);
    uint8_t *out[2][P];
    mok_quantize_args args[P];
    for (int run = 0; run < 2; ++run) {
        for (int p = 0; p < P; ++p) {
            out[run][p] = zalloc_aligned(layout.bytes);
            memset(out[run][p], run ? 0xff : 0x00, layout.bytes); /* every byte must be written */
            args[p] = (mok_quantize_args){w[0][p], w[1][p], w[2][p], s[0], s[1], s[2], out[run][p], NULL};
        }
        st = mok_quantize_weights(ws, args);
        CHECK(st == MOK_OK, "mok_quantize_weights (run %d): %s", run, mok_last_error());
    }
    for (int p = 0; st == MOK_OK && p < P; ++p) {
        CHECK(memcmp(out[0][p], out[1][p], layout.bytes) == 0,
              "rank %d: two calls wrote different bytes (or left some unwritten)", p);
        const uint8_t *b = out[0][p];
        char tag[64];
        static const char *names[3] = {"gate", "up", "down"};
        for (int m = 0; m < 3; ++m) {
            snprintf(tag, sizeof tag, "rank %d %s", p, names[m]);
            const int64_t rows = m == 2 ? H : I, cols = m == 2 ? I : H;
            check_matrix(tag, b + layout.codes[m], (const float *)(b + layout.scales[m]), b + layout.codes[m + 3],
                         (const float *)(b + layout.scales[m + 3]), w[m][p], El, rows, cols);
            snprintf(tag, sizeof tag, "rank %d shared %s", p, names[m]);
            const int sm = MOK_FP8_S_GATE + m;
            check_matrix(tag, b + layout.codes[sm], (const float *)(b + layout.scales[sm]), b + layout.codes[sm + 3],
                         (const float *)(b + layout.scales[sm + 3]), s[m], 1, m == 2 ? H : Is, m == 2 ? Is : H);
        }
        /* the shared expert's quantization is the same on every rank */
        CHECK(memcmp(b + layout.codes[MOK_FP8_S_GATE], out[0][0] + layout.codes[MOK_FP8_S_GATE],
                     layout.bytes - layout.codes[MOK_FP8_S_GATE]) == 0,
              "rank %d's shared expert differs from rank 0's", p);
    }
    for (int p = 0; p < P; ++p) {
        for (int m = 0; m < 3; ++m) free(w[m][p]);
        free(out[0][p]);
        free(out[1][p]);
    }
    for (int m = 0; m < 3; ++m) free(s[m]);
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
}

/* ---- the reference's FP8 function -------------------------------------------------------------- */

/* bf16 rounding of an fp64 value in one step (ties to even), this file's own. */
static double bf16_round(double v) {
    if (!isfinite(v) || v == 0.0) return v;
    int exponent;
    frexp(fabs(v), &exponent);
    const int spacing = exponent - 8 < -133 ? -133 : exponent - 8;
    return copysign(ldexp(rint(ldexp(fabs(v), -spacing)), spacing), v);
}

/* Q of one block (rows x width, stride apart), dequantized in place, by this file's rule. */
static void quantize_block(double *v, int64_t rows, int64_t width, int64_t stride) {
    double amax = 0.0;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < width; ++c) amax = fmax(amax, fabs(v[r * stride + c]));
    const int e = scale_exponent(amax);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < width; ++c)
            v[r * stride + c] = ldexp(e4m3_value(e4m3_nearest(ldexp(v[r * stride + c], -e))), e);
}

static void quantize_rows(double *v, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; c += MOK_FP8_BLOCK) quantize_block(v + r * cols + c, 1, MOK_FP8_BLOCK, cols);
}

static void quantize_matrix(double *v, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r += MOK_FP8_BLOCK)
        for (int64_t c = 0; c < cols; c += MOK_FP8_BLOCK)
            quantize_block(v + r * cols + c, MOK_FP8_BLOCK, MOK_FP8_BLOCK, cols);
}

static double *widen(const uint16_t *v, int64_t n) {
    double *out = malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; ++i) out[i] = mok_bf16_to_float(v[i]);
    return out;
}

/* One expert (gate, up [I, H], down [H, I], already quantized) on one token (x^, dy, dy^ given),
 * forward and backward, straight from mok.h's FP8 section: its output (before the bf16 rounding)
 * into out, its dx part into dx_part, its router dot, its gradients added into dw. */
static double expert_pass(const double *gate, const double *up, const double *down, int64_t H, int64_t I,
                          const double *xq, const double *dy, const double *dyq, double w, double *out, double *dx_part,
                          double *dw_gate, double *dw_up, double *dw_down) {
    double *g = malloc((size_t)I * 8), *u = malloc((size_t)I * 8), *h = malloc((size_t)I * 8);
    double *dg = malloc((size_t)I * 8), *du = malloc((size_t)I * 8);
    for (int64_t i = 0; i < I; ++i) {
        double sg = 0.0, su = 0.0;
        for (int64_t k = 0; k < H; ++k) sg += gate[i * H + k] * xq[k], su += up[i * H + k] * xq[k];
        g[i] = bf16_round(sg);
        u[i] = bf16_round(su);
        h[i] = bf16_round(g[i] / (1.0 + exp(-g[i])) * u[i]);
    }
    quantize_rows(h, 1, I); /* h^ */
    for (int64_t o = 0; o < H; ++o) {
        out[o] = 0.0;
        for (int64_t i = 0; i < I; ++i) out[o] += down[o * I + i] * h[i];
    }
    double dot = 0.0;
    for (int64_t i = 0; i < I; ++i) {
        double dh0 = 0.0;
        for (int64_t o = 0; o < H; ++o) dh0 += down[o * I + i] * dyq[o];
        dot += dh0 * h[i];
        const double s = 1.0 / (1.0 + exp(-g[i])), dh = w * dh0;
        dg[i] = bf16_round(dh * u[i] * s * (1.0 + g[i] * (1.0 - s)));
        du[i] = bf16_round(dh * g[i] * s);
    }
    for (int64_t i = 0; i < I; ++i)
        for (int64_t k = 0; k < H; ++k) dw_gate[i * H + k] += dg[i] * xq[k], dw_up[i * H + k] += du[i] * xq[k];
    for (int64_t o = 0; o < H; ++o)
        for (int64_t i = 0; i < I; ++i) dw_down[o * I + i] += bf16_round(w * dy[o]) * h[i];
    quantize_rows(dg, 1, I); /* dg^, du^: the dx part's operands only */
    quantize_rows(du, 1, I);
    for (int64_t o = 0; o < H; ++o) {
        double sum = 0.0;
        for (int64_t i = 0; i < I; ++i) sum += gate[i * H + o] * dg[i];
        for (int64_t i = 0; i < I; ++i) sum += up[i * H + o] * du[i];
        dx_part[o] = bf16_round(sum);
    }
    free(g), free(u), free(h), free(dg), free(du);
    return dot;
}

static double max_abs_diff(const double *a, const float *b, int64_t n, double *scale) {
    double worst = 0.0;
    *scale = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        worst = fmax(worst, fabs(a[i] - b[i]));
        *scale = fmax(*scale, fabs(a[i]));
    }
    return worst;
}

/* mok_ref_forward / mok_ref_backward of an FP8 layer (one rank, two experts, the shared expert,
 * tokens routed to both, a router weight below zero) against the function computed here. The bf16
 * outputs may differ by one bf16 ulp where the two fp64 sums, in other orders, straddle a rounding
 * midpoint; everything else agrees to fp64 rounding. */
MOK_TEST(fp8_reference_matches_straight_line) {
    rng_state = mok_test_seed() ^ 0x57a1;
    const int64_t H = 256, I = 128, Is = 128, T = 3, k = 2, E = 2;
    const mok_shape shape = {H, I, E, k, Is, T, MOK_PRECISION_FP8};
    uint16_t *x = zalloc_aligned((size_t)(T * H) * 2), *dy = zalloc_aligned((size_t)(T * H) * 2);
    uint16_t *wg = zalloc_aligned((size_t)(E * I * H) * 2), *wu = zalloc_aligned((size_t)(E * I * H) * 2);
    uint16_t *wd = zalloc_aligned((size_t)(E * I * H) * 2), *sg = zalloc_aligned((size_t)(Is * H) * 2);
    uint16_t *su = zalloc_aligned((size_t)(Is * H) * 2), *sd = zalloc_aligned((size_t)(Is * H) * 2);
    for (int64_t i = 0; i < T * H; ++i) {
        /* x's second block an order of magnitude below its first, so their scales differ */
        x[i] = mok_bf16_from_float((float)(rnd_uniform() * (i % H < 128 ? 1.0 : 0.07)));
        dy[i] = mok_bf16_from_float((float)rnd_uniform());
    }
    for (int64_t i = 0; i < E * I * H; ++i) {
        wg[i] = mok_bf16_from_float((float)(0.1 * rnd_uniform()));
        wu[i] = mok_bf16_from_float((float)(0.1 * rnd_uniform()));
        wd[i] = mok_bf16_from_float((float)(0.15 * rnd_uniform()));
    }
    for (int64_t i = 0; i < Is * H; ++i) {
        sg[i] = mok_bf16_from_float((float)(0.1 * rnd_uniform()));
        su[i] = mok_bf16_from_float((float)(0.1 * rnd_uniform()));
        sd[i] = mok_bf16_from_float((float)(0.15 * rnd_uniform()));
    }
    int32_t ids[6] = {0, 1, 1, 0, 1, -1};
    float rw[6] = {0.75f, 0.25f, -0.5f, 1.0f, 0.625f, NAN};
    /* the library's reference */
    const int64_t tokens[1] = {T};
    const void *xs[1] = {x}, *wgs[1] = {wg}, *wus[1] = {wu}, *wds[1] = {wd}, *dys[1] = {dy};
    const int32_t *idss[1] = {ids};
    const float *rws[1] = {rw};
    mok_ref_layer layer = {&shape, 1, 0.0f, tokens, xs, idss, rws, wgs, wus, wds, sg, su, sd};
    uint16_t *y = zalloc_aligned((size_t)(T * H) * 2), *dx = zalloc_aligned((size_t)(T * H) * 2);
    float *drw = zalloc_aligned(6 * 4), *dwg = zalloc_aligned((size_t)(E * I * H) * 4);
    float *dwu = zalloc_aligned((size_t)(E * I * H) * 4), *dwd = zalloc_aligned((size_t)(E * I * H) * 4);
    float *dsg = zalloc_aligned((size_t)(Is * H) * 4), *dsu = zalloc_aligned((size_t)(Is * H) * 4);
    float *dsd = zalloc_aligned((size_t)(Is * H) * 4);
    void *ys[1] = {y}, *dxs[1] = {dx};
    float *drws[1] = {drw}, *dwgs[1] = {dwg}, *dwus[1] = {dwu}, *dwds[1] = {dwd}, *dsgs[1] = {dsg}, *dsus[1] = {dsu},
          *dsds[1] = {dsd};
    mok_status st = mok_ref_forward(&layer, ys);
    CHECK(st == MOK_OK, "mok_ref_forward: %s", mok_last_error());
    if (st == MOK_OK)
        st = mok_ref_backward(&layer, (const void *const *)dys, dxs, drws, dwgs, dwus, dwds, dsgs, dsus, dsds);
    CHECK(st == MOK_OK, "mok_ref_backward: %s", mok_last_error());
    /* the same here */
    double *Wg = widen(wg, E * I * H), *Wu = widen(wu, E * I * H), *Wd = widen(wd, E * I * H);
    double *Sg = widen(sg, Is * H), *Su = widen(su, Is * H), *Sd = widen(sd, Is * H);
    for (int64_t e = 0; e < E; ++e) {
        quantize_matrix(Wg + e * I * H, I, H);
        quantize_matrix(Wu + e * I * H, I, H);
        quantize_matrix(Wd + e * I * H, H, I);
    }
    quantize_matrix(Sg, Is, H), quantize_matrix(Su, Is, H), quantize_matrix(Sd, H, Is);
    double *want_dwg = calloc((size_t)(E * I * H), 8), *want_dwu = calloc((size_t)(E * I * H), 8);
    double *want_dwd = calloc((size_t)(E * I * H), 8), *want_dsg = calloc((size_t)(Is * H), 8);
    double *want_dsu = calloc((size_t)(Is * H), 8), *want_dsd = calloc((size_t)(Is * H), 8);
    double *out = malloc((size_t)H * 8), *part = malloc((size_t)H * 8), *sum_y = malloc((size_t)H * 8);
    double *sum_dx = malloc((size_t)H * 8), want_drw[6];
    int64_t y_off = 0, dx_off = 0, y_ulp = 0;
    for (int64_t t = 0; st == MOK_OK && t < T; ++t) {
        double *xq = widen(x + t * H, H), *dyt = widen(dy + t * H, H), *dyq = widen(dy + t * H, H);
        quantize_rows(xq, 1, H);
        quantize_rows(dyq, 1, H);
        expert_pass(Sg, Su, Sd, H, Is, xq, dyt, dyq, 1.0, out, part, want_dsg, want_dsu, want_dsd);
        for (int64_t o = 0; o < H; ++o) sum_y[o] = bf16_round(out[o]), sum_dx[o] = part[o];
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = ids[t * k + j];
            want_drw[t * k + j] = 0.0;
            if (e < 0) continue;
            want_drw[t * k + j] =
                expert_pass(Wg + e * I * H, Wu + e * I * H, Wd + e * I * H, H, I, xq, dyt, dyq, rw[t * k + j], out,
                            part, want_dwg + e * I * H, want_dwu + e * I * H, want_dwd + e * I * H);
            for (int64_t o = 0; o < H; ++o) sum_y[o] += rw[t * k + j] * bf16_round(out[o]), sum_dx[o] += part[o];
        }
        for (int64_t o = 0; o < H; ++o) {
            const double gy = mok_bf16_to_float(y[t * H + o]), wy = bf16_round(sum_y[o]);
            const double gx = mok_bf16_to_float(dx[t * H + o]), wx = bf16_round(sum_dx[o]);
            y_off += gy != wy, dx_off += gx != wx;
            y_ulp += fabs(gy - wy) > ldexp(fabs(wy), -7) || fabs(gx - wx) > ldexp(fabs(wx), -7);
        }
        free(xq), free(dyt), free(dyq);
    }
    if (st == MOK_OK) {
        CHECK(y_ulp == 0, "%lld elements of y or dx differ by more than one bf16 ulp", (long long)y_ulp);
        CHECK(y_off + dx_off <= 4, "%lld of y's and %lld of dx's %lld elements differ (a few one-ulp flips at most)",
              (long long)y_off, (long long)dx_off, (long long)(T * H));
        double scale;
        double e1 = 0.0;
        for (int s = 0; s < 6; ++s) e1 = fmax(e1, fabs(want_drw[s] - drw[s]) / fmax(fabs(want_drw[s]), 1e-3));
        CHECK(e1 <= 0x1p-23, "d_router_w differs by %.3g relative (the reference's fp32 result: 2^-24)", e1);
        const struct {
            const char *name;
            const double *want;
            const float *got;
            int64_t n;
        } grads[] = {{"dw_gate", want_dwg, dwg, E * I * H}, {"dw_up", want_dwu, dwu, E * I * H},
                     {"dw_down", want_dwd, dwd, E * I * H}, {"ds_gate", want_dsg, dsg, Is * H},
                     {"ds_up", want_dsu, dsu, Is * H},      {"ds_down", want_dsd, dsd, Is * H}};
        for (size_t g = 0; g < sizeof grads / sizeof grads[0]; ++g) {
            const double d = max_abs_diff(grads[g].want, grads[g].got, grads[g].n, &scale);
            /* the reference returns fp32: its rounding, 2^-24 relative, is the difference */
            CHECK(d <= 0x1p-23 * scale, "%s differs by %.3g (scale %.3g)", grads[g].name, d, scale);
        }
    }
    free(x), free(dy), free(wg), free(wu), free(wd), free(sg), free(su), free(sd), free(y), free(dx), free(drw);
    free(dwg), free(dwu), free(dwd), free(dsg), free(dsu), free(dsd), free(Wg), free(Wu), free(Wd), free(Sg), free(Su);
    free(Sd), free(want_dwg), free(want_dwu), free(want_dwd), free(want_dsg), free(want_dsu), free(want_dsd);
    free(out), free(part), free(sum_y), free(sum_dx);
}

/* How far the FP8 function is from the bf16 one, by the two references on a DeepSeek-V3-shaped
 * layer scaled down (H 512, I 256, 16 experts, top-4, shared expert, 2 ranks): printed per tensor
 * as the relative L1 distance (sum |fp8 - bf16| / sum |bf16|) and the largest difference over the
 * tensor's largest value. It must be E4M3's noise: well above bf16's own (2^-9) and well below
 * the values themselves. */
MOK_TEST(fp8_reference_distance_from_bf16) {
    const mok_shape shape = {512, 256, 16, 4, 256, 0, MOK_PRECISION_FP8};
    const int64_t tokens[2] = {48, 40};
    layer L;
    if (layer_make(&L, &shape, 2, tokens, mok_test_seed() ^ 0xd157, LAYER_ROUTE_UNIFORM) != 0) {
        CHECK(0, "layer_make failed");
        layer_free(&L);
        return;
    }
    layer Lb = L; /* the same arrays, bf16 */
    Lb.shape.precision = MOK_PRECISION_BF16;
    layer_result r8 = {0}, r16 = {0};
    mok_status st = layer_run_reference(&L, &r8);
    if (st == MOK_OK) st = layer_run_reference(&Lb, &r16);
    CHECK(st == MOK_OK, "references: %s %s", r8.message, r16.message);
    if (st == MOK_OK) {
        const int64_t H = shape.hidden, k = shape.topk, n = 8 * shape.intermediate * H,
                      ns = shape.shared_intermediate * H;
        static const char *names[] = {"y",       "dx",      "d_router_w", "dw_gate", "dw_up",
                                      "dw_down", "ds_gate", "ds_up",      "ds_down"};
        printf("     FP8 function against bf16 (reference, H 512 I 256 E 16 k 4 I_s 256, 2 ranks): "
               "relative L1, max|diff| / max|bf16|\n");
        for (int t = 0; t < 9; ++t) {
            double diff = 0.0, mass = 0.0, worst = 0.0, top = 0.0;
            for (int p = 0; p < 2; ++p) {
                const int64_t count = t < 2 ? tokens[p] * H : t == 2 ? tokens[p] * k : t < 6 ? n : ns;
                for (int64_t i = 0; i < count; ++i) {
                    double a, b;
                    if (t < 2) {
                        const uint16_t *x8 = t == 0 ? r8.y[p] : r8.dx[p], *x16 = t == 0 ? r16.y[p] : r16.dx[p];
                        a = mok_bf16_to_float(x8[i]), b = mok_bf16_to_float(x16[i]);
                    } else {
                        const float *x8 = t == 2 ? r8.d_router_w[p] : t < 6 ? r8.dw[t - 3][p] : r8.ds[t - 6][p];
                        const float *x16 = t == 2 ? r16.d_router_w[p] : t < 6 ? r16.dw[t - 3][p] : r16.ds[t - 6][p];
                        a = x8[i], b = x16[i];
                    }
                    diff += fabs(a - b), mass += fabs(b);
                    worst = fmax(worst, fabs(a - b)), top = fmax(top, fabs(b));
                }
            }
            const double l1 = diff / mass, rel_max = worst / top;
            printf("       %-10s %.2e  %.2e\n", names[t], l1, rel_max);
            CHECK(l1 > 4e-3 && l1 < 0.25 && rel_max < 0.5,
                  "%s: the FP8 function is %.3g (L1) / %.3g (max) from the bf16 one: not E4M3 noise", names[t], l1,
                  rel_max);
        }
    }
    layer_result_free(&r8);
    layer_result_free(&r16);
    layer_free(&L);
}
