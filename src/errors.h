/* errors.h — the thread-local message of a failed call (errors.c): what every part of the library
 * that refuses an argument uses, the reference included, without the rest of the library. */
#ifndef MOK_ERRORS_H
#define MOK_ERRORS_H

#include "mok.h"

/* Records the thread-local message (printf format) and returns `status`. */
mok_status mok__fail(mok_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mok__clear_error(void);

#endif
