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

static const char *call_name(int kind) {
    switch (kind) {
    case MOK_CALL_WORKSPACE_CREATE: return "mok_workspace_create";
    case MOK_CALL_WORKSPACE_DESTROY: return "mok_workspace_destroy";
    case MOK_CALL_SCHEDULE_BUILD: return "mok_schedule_build";
    case MOK_CALL_FORWARD: return "mok_forward";
    case MOK_CALL_RECOMPUTE: return "mok_recompute_context";
    case MOK_CALL_BACKWARD: return "mok_backward";
    }
    return "no call";
}

void mok__call_describe(const mok_call *c, char *out, size_t size) {
    int n;
    if (c->kind == MOK_CALL_WORKSPACE_CREATE || c->kind == MOK_CALL_WORKSPACE_DESTROY)
        n = snprintf(out, size, "%s of workspace #%lld", call_name(c->kind), (long long)c->workspace);
    else
        n = snprintf(out, size, "%s #%lld on workspace #%lld", call_name(c->kind), (long long)c->seq,
                     (long long)c->workspace);
    if (n < 0 || (size_t)n >= size) return;
    if (c->build > 0) n += snprintf(out + n, size - (size_t)n, " with schedule build #%lld", (long long)c->build);
    if (n >= 0 && (size_t)n < size && c->step > 0)
        snprintf(out + n, size - (size_t)n, " (at its barrier %d)", c->step + 1);
}
