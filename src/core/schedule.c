/* schedule.c — the schedule for the host library: the portable definitions (schedule.inc) with
 * external linkage, used by the cpu backend and the tests. */
#include "schedule.inc"
