/* progress.h — what `mok run` shows while it works, so that a long run is never silent: one line
 * per run (or per reference check), to which each pass adds its time as it completes, closed
 * with the time since the command started. On a terminal, a pass that is still running shows a
 * ticking "forward ... 12 s" at the end of its line, redrawn once a second by a thread of its own.
 *
 *   tools_progress *p = tools_progress_start(stdout);
 *   tools_progress_line(p, "run 1/3");
 *   tools_progress_pass(p, "forward");  ... the pass ...  tools_progress_done(p, seconds);
 *   tools_progress_end_line(p);
 *   tools_progress_stop(p);
 *
 * A NULL progress (tools_progress_start could not start) is accepted everywhere and shows nothing. */
#ifndef MOK_TOOLS_PROGRESS_H
#define MOK_TOOLS_PROGRESS_H

#include <stdio.h>

typedef struct tools_progress tools_progress;

/* Seconds on a monotonic clock (for the lengths of passes and runs). */
double tools_now_seconds(void);

/* Writes to out; ticks when out is a terminal. */
tools_progress *tools_progress_start(FILE *out);
void tools_progress_stop(tools_progress *progress);

void tools_progress_line(tools_progress *progress, const char *label);
void tools_progress_pass(tools_progress *progress, const char *pass);
void tools_progress_done(tools_progress *progress, double seconds);
void tools_progress_end_line(tools_progress *progress);

#endif
