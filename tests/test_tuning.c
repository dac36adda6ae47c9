/* test_tuning.c — the cuda backend's tuning table (cuda/tuning.h), on any machine: the rules
 * behind its defaults, its resolution from a shape, a config and the environment, its text, and
 * mok_workspace_tuning's argument rules (on a cpu workspace, which has no knobs). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda/tuning.h"
#include "mok.h"
#include "test.h"

/* The comm CTAs a pass with turned transfers takes (mok__cuda_comm_ctas_scaled), on EP2 DeepSeek-V3 at
 * skew 1.5 (the benchmark's routing: 111,184 and 19,888 routed rows, 8192 tokens × 8 slots per
 * rank) and at balance. */
MOK_TEST(tuning_comm_ctas_scaled) {
    mok_plan p;
    memset(&p, 0, sizeof p);
    p.num_tokens = 8192;
    p.intermediate = 2048;
    p.shared_intermediate = 2048;
    p.nranks = 2;
    const int64_t own = 8192 * 8;
    /* default directions: the balanced count whatever the routing */
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 111184) == 16, "default, heavy rank");
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 19888) == 16, "default, light rank");
    /* every transfer turned, forward and backward: the heavy rank gives workers to compute
       (16 x 73728 / 119376 = 9.9), the light one takes them up to the cap */
    p.dispatch_push = p.combine_pull = 1;
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 111184) == 10, "turned forward, heavy: %d",
          mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 111184));
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 19888) == 33, "turned forward, light: capped");
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, own) == 16, "turned forward, balanced");
    p.dispatch_push = p.combine_pull = 0;
    p.backward = 1;
    p.combine_push = p.dispatch_pull = 1;
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 111184) == 10, "turned backward, heavy");
    /* one direction turned: the pulled half still follows the rank's own rows */
    p.dispatch_pull = 0; /* moved = 2 S + R: (2 + 1.697) / 3 x 0.6176 = 0.761 */
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 111184) == 12, "backward, reverse-combine pushed, heavy: %d",
          mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 111184));
    /* no tokens or no rows: the balanced count; never below 1 */
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, 0, 111184) == 16, "no tokens");
    CHECK(mok__cuda_comm_ctas_scaled(&p, 16, 33, own, 0) == 16, "no rows");
    CHECK(mok__cuda_comm_ctas_scaled(&p, 1, 33, own, 10 * own) >= 1, "at least one");
}

/* The comm CTAs a pass gets when the config leaves them to the backend. */
MOK_TEST(tuning_comm_ctas) {
    /* DeepSeek-V3 (I = 2048, I_s = 2048, k = 8: I_eff 2304, 12288 / 2304 -> 6) on 132 SMs */
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 1, 0, 0, 0, 132) == 8, "DeepSeek EP1 forward: the one-rank floor");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 1, 1, 0, 0, 132) == 12, "DeepSeek EP1 backward: the one-rank backward's floor");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 2, 0, 0, 0, 132) == 10, "DeepSeek EP2 forward: %d",
          mok__cuda_comm_ctas(2048, 2048, 8, 2, 0, 0, 0, 132));
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 2, 1, 0, 0, 132) == 16, "DeepSeek EP2 backward");
    /* one rank whose down / dx tiles store their own rows: the floors 4 and 8 */
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 1, 0, 1, 0, 132) == 4, "DeepSeek EP1 direct forward");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 1, 1, 1, 0, 132) == 8, "DeepSeek EP1 direct backward");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 2, 1, 1, 0, 132) == 16, "direct means nothing across ranks");
    /* Qwen3-30B-A3B (I = 768, no shared expert): ceil(12288 / 768) = 16, but ceil(15360 / 768) =
       20 in the one-rank backward; direct: ceil(9216 / 768) = 12 and ceil(12288 / 768) = 16 */
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 1, 0, 0, 0, 132) == 16, "Qwen EP1 forward");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 1, 1, 0, 0, 132) == 20, "Qwen EP1 backward");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 1, 0, 1, 0, 132) == 12, "Qwen EP1 direct forward");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 1, 1, 1, 0, 132) == 16, "Qwen EP1 direct backward");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 2, 0, 0, 0, 132) == 16, "Qwen EP2 forward");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 2, 1, 0, 0, 132) == 16, "Qwen EP2 backward");
    /* narrow experts: by bytes, capped at a quarter of the SMs */
    CHECK(mok__cuda_comm_ctas(128, 0, 8, 2, 0, 0, 0, 132) == 33, "I = 128: capped at 132 / 4");
    /* small GPUs: the cap, and at least one SM left to compute */
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 2, 1, 0, 0, 8) == 2, "8 SMs: a quarter");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 2, 1, 0, 0, 2) == 1, "2 SMs: one each");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 0, 2, 1, 0, 0, 132) == 16, "k = 0 does not divide by zero");
    /* FP8: the backward's pulls take about 1.7 times a bf16 pull's time per row: 1.5 times the
       CTAs, at least twice the floor */
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 1, 1, 1, 1, 132) == 16, "DeepSeek EP1 direct FP8 backward: twice the floor");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 1, 1, 1, 1, 132) == 16, "Qwen EP1 direct FP8 backward: bf16's 16");
    CHECK(mok__cuda_comm_ctas(2048, 2048, 8, 1, 0, 1, 1, 132) == 4, "the FP8 forward's as bf16's");
    CHECK(mok__cuda_comm_ctas(768, 0, 8, 1, 1, 0, 1, 132) == 24, "Qwen EP1 FP8 backward: twice the floor of 12");
    CHECK(mok__cuda_comm_ctas(256, 0, 8, 1, 1, 0, 1, 132) == 33, "I = 256 FP8 backward: 60, capped");
}

/* A stand-in for getenv: the variables of one case, "NAME=VALUE" each. */
static const char *const *fake_env;
static const char *lookup(const char *name) {
    const size_t n = strlen(name);
    for (const char *const *v = fake_env; v && *v; ++v)
        if (strncmp(*v, name, n) == 0 && (*v)[n] == '=') return *v + n + 1;
    return NULL;
}

#define H200_L2_BYTES (60ll << 20)

static mok_cuda_tuning resolve(const mok_shape *s, const mok_config *c, int nranks, int tma_found,
                               const char *const *env) {
    mok_cuda_tuning t;
    memset(&t, 0x5a, sizeof t); /* poisoned: every knob must be written */
    fake_env = env;
    mok__cuda_tuning_resolve(&t, s, c, nranks, 132, H200_L2_BYTES, tma_found, lookup);
    fake_env = NULL;
    return t;
}

/* Defaults from the shape and config, and each variable of the table overriding its knob (values
 * it does not name leave the default). */
MOK_TEST(tuning_resolve) {
    const mok_config config = MOK_CONFIG_INIT;
    const mok_shape dsv3 = {7168, 2048, 64, 8, 2048, 8192, MOK_PRECISION_BF16};
    const mok_shape qwen = {2048, 768, 128, 8, 0, 16384, MOK_PRECISION_BF16};
    const mok_shape odd = {320, 192, 8, 4, 192, 600, MOK_PRECISION_BF16};
    mok_cuda_tuning t = resolve(&dsv3, &config, 2, 1, NULL);
    CHECK(t.tma == 1 && t.handoff == 1 && t.direct_rows == 1 && t.raster == 16 && t.cols_gateup == 128 &&
              t.cols_dh == 256 && t.cols_h == 256 && t.stream_spans == 1,
          "DeepSeek-V3: tma %d handoff %d direct_rows %d raster %d cols %d / %d / %d stream_spans %d", t.tma,
          t.handoff, t.direct_rows, t.raster, t.cols_gateup, t.cols_dh, t.cols_h, t.stream_spans);
    CHECK(t.fwd_comm_ctas == mok__cuda_comm_ctas(2048, 2048, 8, 2, 0, 0, 0, 132) &&
              t.bwd_comm_ctas == mok__cuda_comm_ctas(2048, 2048, 8, 2, 1, 0, 0, 132),
          "DeepSeek-V3 EP2 comm CTAs %d / %d", t.fwd_comm_ctas, t.bwd_comm_ctas);
    t = resolve(&qwen, &config, 1, 1, NULL);
    CHECK(t.raster == 1 && t.cols_gateup == 128 && t.cols_dh == 256 && t.cols_h == 256,
          "Qwen3: raster %d cols %d / %d / %d", t.raster, t.cols_gateup, t.cols_dh, t.cols_h);
    /* one rank with the default directions: the down / dx tiles store their rows (direct) */
    CHECK(t.fwd_comm_ctas == mok__cuda_comm_ctas(768, 0, 8, 1, 0, 1, 0, 132) &&
              t.bwd_comm_ctas == mok__cuda_comm_ctas(768, 0, 8, 1, 1, 1, 0, 132),
          "Qwen3 EP1 comm CTAs %d / %d", t.fwd_comm_ctas, t.bwd_comm_ctas);
    const mok_shape glm = {5120, 1536, 160, 8, 1536, 8192, MOK_PRECISION_BF16};
    t = resolve(&glm, &config, 1, 1, NULL);
    CHECK(t.cols_dh == 256, "I 1536: dh %d columns", t.cols_dh);
    const mok_shape i640 = {2048, 640, 64, 8, 0, 8192, MOK_PRECISION_BF16};
    t = resolve(&i640, &config, 1, 1, NULL);
    CHECK(t.cols_dh == 128, "I 640: dh %d columns (the widest that divides it)", t.cols_dh);
    t = resolve(&odd, &config, 1, 1, NULL);
    CHECK(t.cols_gateup == 64 && t.cols_dh == 64 && t.cols_h == 64, "H 320, I 192: cols %d / %d / %d",
          t.cols_gateup, t.cols_dh, t.cols_h);

    const char *const off[] = {"MOK_CUDA_TMA=0",      "MOK_CUDA_HANDOFF=0",   "MOK_CUDA_DIRECT_ROWS=0",
                               "MOK_CUDA_RASTER=3",   "MOK_CUDA_COLS_H=64",   "MOK_CUDA_COLS_DH=128",
                               "MOK_CUDA_STREAM_SPANS=0", NULL};
    t = resolve(&dsv3, &config, 2, 1, off);
    CHECK(t.tma == 0 && t.handoff == 0 && t.direct_rows == 0 && t.raster == 3 && t.cols_h == 64 && t.cols_dh == 128 &&
              t.stream_spans == 0,
          "overridden: tma %d handoff %d direct_rows %d raster %d cols_h %d cols_dh %d stream_spans %d", t.tma,
          t.handoff, t.direct_rows, t.raster, t.cols_h, t.cols_dh, t.stream_spans);
    CHECK(resolve(&dsv3, &config, 2, 0, NULL).tma == 0, "no encoder: no TMA");
    const char *const junk[] = {"MOK_CUDA_RASTER=65",       "MOK_CUDA_COLS_H=96",      "MOK_CUDA_COLS_DH=512",
                                "MOK_CUDA_HANDOFF=2",       "MOK_CUDA_DIRECT_ROWS=10", "MOK_CUDA_STREAM_SPANS=10",
                                NULL};
    t = resolve(&dsv3, &config, 2, 1, junk);
    CHECK(t.raster == 16 && t.cols_h == 256 && t.cols_dh == 256 && t.handoff == 1 && t.direct_rows == 1 &&
              t.stream_spans == 1,
          "values outside the table's: raster %d cols %d / %d handoff %d direct_rows %d stream_spans %d", t.raster,
          t.cols_h, t.cols_dh, t.handoff, t.direct_rows, t.stream_spans);
    const char *const wide[] = {"MOK_CUDA_COLS_DH=256", "MOK_CUDA_COLS_H=256", NULL};
    t = resolve(&qwen, &config, 1, 1, wide);
    CHECK(t.cols_dh == 256 && t.cols_h == 256, "Qwen3, 256 named: cols_dh %d cols_h %d", t.cols_dh, t.cols_h);
    CHECK(resolve(&odd, &config, 1, 1, wide).cols_dh == 64, "I 192 with 256 named: halved until it divides");
    const char *const zero[] = {"MOK_CUDA_RASTER=0", NULL};
    CHECK(resolve(&qwen, &config, 1, 1, zero).raster == 1, "raster 0: the default");

    mok_config fixed = config;
    fixed.fwd_comm_sms = 5;
    fixed.bwd_comm_sms = 500;
    t = resolve(&dsv3, &fixed, 2, 1, NULL);
    CHECK(t.fwd_comm_ctas == 5 && t.bwd_comm_ctas == 131, "configured comm CTAs %d / %d (at most all SMs but one)",
          t.fwd_comm_ctas, t.bwd_comm_ctas);
}

/* The walk's runs: tile-major where an expert's gate|up weights fit in half the L2, else the power
 * of two nearest sqrt(2 W) for W compute CTAs; the layers of the benchmark on an H200. */
MOK_TEST(tuning_raster) {
    const int64_t l2 = H200_L2_BYTES;
    CHECK(mok__cuda_raster(2048, 768, 124, l2) == 1, "Qwen3-30B-A3B (6 MB of gate|up per expert): tile-major");
    CHECK(mok__cuda_raster(4096, 1024, 124, l2) == 1, "Qwen3.5-397B-A17B (17 MB): tile-major");
    CHECK(mok__cuda_raster(7168, 2048, 124, l2) == 16, "DeepSeek-V3 (59 MB): %d", mok__cuda_raster(7168, 2048, 124, l2));
    CHECK(mok__cuda_raster(6144, 2048, 122, l2) == 16, "GLM-5.2 (50 MB): runs");
    CHECK(mok__cuda_raster(4096, 14336, 128, l2) == 16, "Mixtral-8x7B (235 MB): runs");
    CHECK(mok__cuda_raster(7168, 2048, 124, 4 * l2) == 1, "a larger L2 keeps DeepSeek-V3's experts: tile-major");
    CHECK(mok__cuda_raster(4096, 14336, 60, l2) == 8 && mok__cuda_raster(4096, 14336, 32, l2) == 8 &&
              mok__cuda_raster(4096, 14336, 16, l2) == 4 && mok__cuda_raster(4096, 14336, 1, l2) == 1,
          "fewer compute CTAs, shorter runs: %d %d %d %d", mok__cuda_raster(4096, 14336, 60, l2),
          mok__cuda_raster(4096, 14336, 32, l2), mok__cuda_raster(4096, 14336, 16, l2),
          mok__cuda_raster(4096, 14336, 1, l2));
}

/* The text: every knob in table order, and snprintf's answer when it does not fit. */
MOK_TEST(tuning_format) {
    const mok_cuda_tuning t = {1, 0, 1, 8, 128, 256, 64, 10, 16, 1};
    const char *want = "tma=1 handoff=0 direct_rows=1 raster=8 cols_gateup=128 cols_dh=256 cols_h=64 "
                       "fwd_comm_ctas=10 bwd_comm_ctas=16 stream_spans=1";
    char text[128];
    memset(text, 'x', sizeof text);
    const size_t n = mok__cuda_tuning_format(&t, text, sizeof text);
    CHECK(n == strlen(want) && strcmp(text, want) == 0, "format: '%s' (%zu)", text, n);
    char small[10];
    CHECK(mok__cuda_tuning_format(&t, small, sizeof small) == strlen(want) && strlen(small) == sizeof small - 1 &&
              strncmp(small, want, sizeof small - 1) == 0,
          "truncated: '%s'", small);
    CHECK(mok__cuda_tuning_format(&t, NULL, 0) == strlen(want), "length only");
}

/* mok_workspace_tuning's arguments, on a cpu workspace (no knobs: ""). */
MOK_TEST(tuning_workspace_call) {
    mok_group *g = NULL;
    mok_workspace *ws = NULL;
    const mok_shape shape = {128, 128, 4, 2, 0, 16, MOK_PRECISION_BF16};
    if (mok_group_create_local(&g, MOK_BACKEND_CPU, 1, NULL, NULL) != MOK_OK ||
        mok_workspace_create(&ws, g, &shape, NULL) != MOK_OK) {
        CHECK(0, "cpu group and workspace: %s", mok_last_error());
        mok_group_destroy(g);
        return;
    }
    char text[64] = "poison";
    CHECK(mok_workspace_tuning(ws, text, sizeof text) == MOK_OK && text[0] == '\0', "cpu: '%s'", text);
    CHECK(mok_workspace_tuning(NULL, text, sizeof text) == MOK_ERR_INVALID_ARGUMENT &&
              strstr(mok_last_error(), "workspace") != NULL,
          "NULL workspace: %s", mok_last_error());
    CHECK(mok_workspace_tuning(ws, NULL, sizeof text) == MOK_ERR_INVALID_ARGUMENT &&
              strstr(mok_last_error(), "text") != NULL,
          "NULL text: %s", mok_last_error());
    CHECK(mok_workspace_tuning(ws, text, 0) == MOK_ERR_INVALID_ARGUMENT && strstr(mok_last_error(), "size") != NULL,
          "size 0: %s", mok_last_error());
    mok_workspace_destroy(ws);
    mok_group_destroy(g);
}
