/* options.h — the command line of `mok run`: its options, their parsing (every value is checked
 * here, with a message that names the flag), and the translation of the library's messages about
 * the config and the shape back into the flag the user typed. */
#ifndef MOK_TOOLS_OPTIONS_H
#define MOK_TOOLS_OPTIONS_H

#include <stdint.h>
#include <stdio.h>

#include "mok.h"
#include "presets.h"

/* --check without --check-tokens: every token when H*I is at most this, else the first
 * CHECK_TOKENS_LARGE tokens of each rank (the fp64 reference is naive). */
#define CHECK_FULL_MAX_HI (512 * 512)
#define CHECK_TOKENS_LARGE 32

/* --scale divides a preset; 1 is the published layer, and past TOOLS_SCALE_MAX every dimension
 * is already down to one tile. */
#define TOOLS_SCALE_MAX 4096.0

typedef struct run_options {
    const tools_preset *preset;
    double scale;         /* in [1, TOOLS_SCALE_MAX] */
    int nranks;
    int64_t tokens;       /* per rank; -1 = tools_default_tokens(scale) */
    int precision;        /* mok_precision: --precision bf16 (the default) or fp8 */
    int uneven;
    double skew;
    uint64_t seed;
    mok_backend backend;
    int check;
    int hash;             /* --hash: the outputs' hash and the runs' bitwise agreement, no reference */
    int64_t check_tokens; /* per rank; -1 = the default (CHECK_FULL_MAX_HI) */
    int no_backward;
    int fp8_alone;        /* --fp8-alone: no bf16 runs beside the FP8 ones */
    int repeat;
    const char *trace_path;
    mok_config config;
} run_options;

void tools_usage(FILE *out);

/* Parses the arguments after `mok run`. Returns 0 to run, 1 after printing help, -1 on a bad
 * argument (message printed). */
int tools_parse_run_options(int argc, char **argv, run_options *opt);

/* Prints a failed library call's message. A message about a config field or the shape that a
 * flag sets is given as `mok run: --flag: ...` with the library's field names replaced by the
 * flags (config.minibatch_rows -> --minibatch, nranks -> --ranks); any other as
 * `mok: <function>: <status>: <message>`. Returns -1. */
int tools_library_failed(const char *function, mok_status status);

#endif
