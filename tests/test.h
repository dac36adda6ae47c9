/* test.h — the tiny harness every C test file uses. A test is a function registered with
 * MOK_TEST(name); CHECK records a failure with its file and line and goes on; the runner prints
 * one line per test and the closing line `N passed, N failed`. */
#ifndef MOK_TEST_H
#define MOK_TEST_H

#include <stdio.h>
#include <stdlib.h>

typedef struct mok_test_case {
    const char *name;
    void (*fn)(void);
} mok_test_case;

void mok_test_register(const char *name, void (*fn)(void));
void mok_test_fail(const char *file, int line, const char *fmt, ...);
/* Marks the running test skipped (why: printf format); it counts as skipped, not passed. */
void mok_test_skip(const char *fmt, ...);
int mok_test_quick(void); /* 1 under MOK_TEST_QUICK=1 (sanitizer runs): tests shrink their matrix */
unsigned long long mok_test_seed(void); /* printed once; MOK_TEST_SEED=N reproduces a run */
/* 1 unless MOK_TEST_CASE is set and not part of `name`: a layer-case test runs one case of many. */
int mok_test_case_selected(const char *name);

#define MOK_TEST(name)                                                               \
    static void name(void);                                                          \
    __attribute__((constructor)) static void name##_register(void) { mok_test_register(#name, name); } \
    static void name(void)

#define CHECK(cond, ...)                                                            \
    do {                                                                            \
        if (!(cond)) mok_test_fail(__FILE__, __LINE__, "" __VA_ARGS__);             \
    } while (0)

#endif
