/* main.c — the test runner: runs every registered test (or those whose name contains argv[1])
 * and closes with `N passed, N failed`. MOK_TEST_SEED=N replays a run's random inputs;
 * MOK_TEST_QUICK=1 shortens the slow cases; MOK_TEST_ERRORS=1 prints every tensor's error of each
 * layer comparison (layer.c), passing or not, for the tolerances' statistics; MOK_TEST_CASE=TEXT
 * runs only the cases whose name contains TEXT in the tests that ask (mok_test_case_selected). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "test.h"

#define MAX_TESTS 512
static mok_test_case tests[MAX_TESTS];
static int num_tests;
static int current_failures;
static int current_skipped;

void mok_test_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("     skip: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    current_skipped = 1;
}

void mok_test_register(const char *name, void (*fn)(void)) {
    if (num_tests < MAX_TESTS) tests[num_tests++] = (mok_test_case){name, fn};
}

void mok_test_fail(const char *file, int line, const char *fmt, ...) {
    if (current_failures < 8) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "    %s:%d: ", file, line);
        vfprintf(stderr, fmt, ap);
        fprintf(stderr, "\n");
        va_end(ap);
    }
    ++current_failures;
}

int mok_test_quick(void) {
    const char *q = getenv("MOK_TEST_QUICK");
    return q && q[0] == '1';
}

static unsigned long long seed;
unsigned long long mok_test_seed(void) { return seed; }

int mok_test_case_selected(const char *name) {
    const char *only = getenv("MOK_TEST_CASE");
    return !only || !only[0] || strstr(name, only) != NULL;
}

static int by_name(const void *a, const void *b) {
    return strcmp(((const mok_test_case *)a)->name, ((const mok_test_case *)b)->name);
}

int main(int argc, char **argv) {
    const char *env = getenv("MOK_TEST_SEED");
    seed = env ? strtoull(env, NULL, 10) : (unsigned long long)time(NULL);
    printf("seed %llu (MOK_TEST_SEED=%llu reproduces)\n", seed, seed);
    qsort(tests, (size_t)num_tests, sizeof tests[0], by_name);
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < num_tests; ++i) {
        if (argc > 1 && !strstr(tests[i].name, argv[1])) continue;
        current_failures = 0;
        current_skipped = 0;
        clock_t start = clock();
        tests[i].fn();
        double secs = (double)(clock() - start) / CLOCKS_PER_SEC;
        if (current_failures == 0 && current_skipped) {
            ++skipped;
            printf("SKIP %-48s\n", tests[i].name);
        } else if (current_failures == 0) {
            ++passed;
            printf("PASS %-48s %6.2fs\n", tests[i].name, secs);
        } else {
            ++failed;
            printf("FAIL %-48s (%d checks failed)\n", tests[i].name, current_failures);
        }
        fflush(stdout);
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
