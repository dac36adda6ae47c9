/* errors.c — status strings from the one table in mok.h, and the thread-local message that
 * names the argument and the rule a failed call broke. */
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[1024];

const char *mok_status_string(mok_status status) {
    switch (status) {
#define MOK_X_CASE(name, value, text) \
    case name:                        \
        return text;
        MOK_STATUS_TABLE(MOK_X_CASE)
#undef MOK_X_CASE
    }
    return "unknown status";
}

const char *mok_last_error(void) { return last_error; }

void mok__clear_error(void) { last_error[0] = '\0'; }

mok_status mok__fail(mok_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}
