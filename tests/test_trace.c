/* test_trace.c — mok_trace_write on the cpu backend keeps the last forward and the last backward:
 * after a forward the file holds that forward only; after the backward both, the backward's tasks
 * after the forward's on one time axis; after another forward, the new forward (as many tasks as
 * the first, the same layer) beside the old backward. Every (rank, pass) is a process named
 * "rank R forward" / "rank R backward" with pid R / MOK_MAX_RANKS + R, every worker that ran a
 * task a thread named "comm worker W" or "compute worker W", and each event's kind belongs to
 * its pass. One rank's passes have no combine or push events (the tiles write in place), two
 * ranks' have both. The file is read line by line: the writer puts one event on each line. The
 * writer itself on made-up GPU events: a CTA's residency event carries its SM cycles. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "layer.h"
#include "test.h"

#define TRACE_RANKS 2

typedef struct trace_counts {
    int tasks[2][TRACE_RANKS];          /* complete events per pass and rank */
    int named_process[2][TRACE_RANKS];  /* process_name events naming it */
    int named_threads[2][TRACE_RANKS];  /* thread_name events */
    int workers_unnamed;                /* an event of a (pid, tid) with no thread name before it */
    int wrong_pass;                     /* an event whose kind, pid or args disagree with its pass */
    double forward_end, backward_start; /* the latest forward end, the earliest backward start (us) */
    int lines;
} trace_counts;

static const char *const forward_kinds[] = {"dispatch", "gateup", "down", "combine", "shared_up", "shared_down"};

static int is_forward_kind(const char *name) {
    for (size_t i = 0; i < sizeof forward_kinds / sizeof forward_kinds[0]; ++i)
        if (strcmp(name, forward_kinds[i]) == 0) return 1;
    return 0;
}

/* One complete event: its kind, pid, tid, times and the pass and rank of its args. */
static void count_event(trace_counts *c, const char *line, int named[][64]) {
    char name[32] = "", pass[16] = "";
    int pid = -1, tid = -1, rank = -1, minibatch = 0;
    double ts = 0.0, dur = 0.0;
    const char *n = strstr(line, "\"name\":\""), *p = strstr(line, "\"pid\":"), *a = strstr(line, "\"args\":");
    if (!n || !p || !a || sscanf(n, "\"name\":\"%31[^\"]\"", name) != 1 ||
        sscanf(p, "\"pid\":%d,\"tid\":%d,\"ts\":%lf,\"dur\":%lf", &pid, &tid, &ts, &dur) != 4 ||
        sscanf(a, "\"args\":{\"rank\":%d,\"pass\":\"%15[^\"]\",\"minibatch\":%d", &rank, pass, &minibatch) != 3) {
        ++c->wrong_pass;
        return;
    }
    const int backward = strcmp(pass, "backward") == 0;
    if ((!backward && strcmp(pass, "forward") != 0) || rank < 0 || rank >= TRACE_RANKS ||
        pid != (backward ? MOK_MAX_RANKS : 0) + rank || is_forward_kind(name) == backward) {
        ++c->wrong_pass;
        return;
    }
    ++c->tasks[backward][rank];
    if (tid < 0 || tid >= 64 || !named[backward * TRACE_RANKS + rank][tid]) ++c->workers_unnamed;
    if (backward && (c->backward_start < 0.0 || ts < c->backward_start)) c->backward_start = ts;
    if (!backward && ts + dur > c->forward_end) c->forward_end = ts + dur;
}

/* A process_name or thread_name event. */
static void count_name(trace_counts *c, const char *line, int named[][64]) {
    int pid = -1, tid = -1, rank = -1, worker = -1;
    char pass[16] = "", role[16] = "";
    const char *p = strstr(line, "\"pid\":");
    if (!p) return;
    if (strstr(line, "\"process_name\"")) {
        if (sscanf(p, "\"pid\":%d,\"args\":{\"name\":\"rank %d %15[a-z]\"", &pid, &rank, pass) != 3) return;
        const int backward = strcmp(pass, "backward") == 0;
        if (rank >= 0 && rank < TRACE_RANKS && pid == (backward ? MOK_MAX_RANKS : 0) + rank)
            ++c->named_process[backward][rank];
    } else if (strstr(line, "\"thread_name\"")) {
        if (sscanf(p, "\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%15s worker %d\"", &pid, &tid, role, &worker) != 4)
            return;
        const int backward = pid >= MOK_MAX_RANKS;
        rank = pid - (backward ? MOK_MAX_RANKS : 0);
        if (rank >= 0 && rank < TRACE_RANKS && tid == worker && tid >= 0 && tid < 64 &&
            (strcmp(role, "comm") == 0 || strcmp(role, "compute") == 0)) {
            ++c->named_threads[backward][rank];
            named[backward * TRACE_RANKS + rank][tid] = 1;
        }
    }
}

static int read_trace(const char *path, trace_counts *c) {
    memset(c, 0, sizeof *c);
    c->forward_end = -1.0;
    c->backward_start = -1.0;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    static int named[2 * TRACE_RANKS][64];
    memset(named, 0, sizeof named);
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        ++c->lines;
        if (strstr(line, "\"ph\":\"M\"")) count_name(c, line, named);
        else if (strstr(line, "\"ph\":\"X\"")) count_event(c, line, named);
    }
    fclose(f);
    return 0;
}

static void check_pass(const trace_counts *c, int backward, int present, const char *when) {
    for (int r = 0; r < TRACE_RANKS; ++r) {
        CHECK((c->tasks[backward][r] > 0) == present, "%s: rank %d has %d %s events", when, r, c->tasks[backward][r],
              backward ? "backward" : "forward");
        CHECK(c->named_process[backward][r] == present, "%s: rank %d %s named %d times", when, r,
              backward ? "backward" : "forward", c->named_process[backward][r]);
        CHECK((c->named_threads[backward][r] > 0) == present, "%s: rank %d %s names %d threads", when, r,
              backward ? "backward" : "forward", c->named_threads[backward][r]);
    }
}

/* A small layer on `ranks` ranks (150 and 97 tokens; with or without a shared expert) and the cpu
 * backend open on it with several minibatches and macrobatches, three threads, traced. Returns
 * whether the backend opened (else B->message says why). */
static int traced_layer(layer *L, layer_backend *B, int ranks, int64_t experts, int64_t shared, uint64_t seed) {
    const int64_t tokens[TRACE_RANKS] = {150, 97};
    const mok_shape shape = {.hidden = 128, .intermediate = 64, .num_experts = experts, .topk = 2,
                             .shared_intermediate = shared, .max_tokens = 150, .precision = MOK_PRECISION_BF16};
    CHECK(layer_make(L, &shape, ranks, tokens, seed, LAYER_ROUTE_UNIFORM) == 0, "layer_make");
    mok_config config = mok_config_default();
    config.minibatch_rows = 128;
    config.ring_rows = 256;
    config.cpu_threads = 3;
    config.trace = 1;
    const int ok = layer_backend_open(B, L, &config) == MOK_OK;
    CHECK(ok, "%d ranks: open: %s", ranks, B->message);
    return ok;
}

MOK_TEST(trace_keeps_last_forward_and_backward) {
    layer L;
    layer_backend B;
    layer_result got = {0};
    char path[96];
    snprintf(path, sizeof path, "/tmp/mok_test_trace_passes_%d.json", (int)getpid());
    trace_counts first = {0}, both = {0}, again = {0};
    int ok = traced_layer(&L, &B, TRACE_RANKS, 6, 64, mok_test_seed() + 31);
    if (ok) {
        ok = layer_backend_forward(&B, &L, &got) == MOK_OK && mok_trace_write(B.workspace, path) == MOK_OK &&
             read_trace(path, &first) == 0;
        CHECK(ok, "forward and trace: %s / %s", got.message, mok_last_error());
    }
    if (ok) {
        check_pass(&first, 0, 1, "after the forward");
        check_pass(&first, 1, 0, "after the forward");
        ok = layer_backend_backward(&B, &L, 0, &got) == MOK_OK && mok_trace_write(B.workspace, path) == MOK_OK &&
             read_trace(path, &both) == 0;
        CHECK(ok, "backward and trace: %s / %s", got.message, mok_last_error());
    }
    if (ok) {
        check_pass(&both, 0, 1, "after the backward");
        check_pass(&both, 1, 1, "after the backward");
        for (int r = 0; r < TRACE_RANKS; ++r)
            CHECK(both.tasks[0][r] == first.tasks[0][r], "rank %d: the forward's %d events became %d", r,
                  first.tasks[0][r], both.tasks[0][r]);
        CHECK(both.backward_start >= both.forward_end, "the backward starts at %.3f us, before the forward's end %.3f",
              both.backward_start, both.forward_end);
        layer_result second = {0};
        ok = layer_backend_forward(&B, &L, &second) == MOK_OK && mok_trace_write(B.workspace, path) == MOK_OK &&
             read_trace(path, &again) == 0;
        CHECK(ok, "second forward and trace: %s / %s", second.message, mok_last_error());
        layer_result_free(&second);
    }
    if (ok) {
        check_pass(&again, 0, 1, "after a second forward");
        check_pass(&again, 1, 1, "after a second forward");
        for (int r = 0; r < TRACE_RANKS; ++r) {
            CHECK(again.tasks[0][r] == first.tasks[0][r], "rank %d: a forward of the same layer has %d events, not %d",
                  r, again.tasks[0][r], first.tasks[0][r]);
            CHECK(again.tasks[1][r] == both.tasks[1][r], "rank %d: the kept backward has %d events, not %d", r,
                  again.tasks[1][r], both.tasks[1][r]);
        }
        CHECK(again.forward_end >= again.backward_start, "the second forward does not come after the backward");
    }
    const trace_counts *all[] = {&first, &both, &again};
    for (int i = 0; ok && i < 3; ++i)
        CHECK(all[i]->wrong_pass == 0 && all[i]->workers_unnamed == 0,
              "file %d: %d events with a wrong pass, %d of an unnamed worker", i, all[i]->wrong_pass,
              all[i]->workers_unnamed);
    remove(path);
    layer_result_free(&got);
    layer_backend_close(&B);
    layer_free(&L);
}

/* Events of kind `name` in a trace file (the writer puts one event on each line). */
static int count_kind(const char *path, const char *name) {
    char key[64], line[1024];
    snprintf(key, sizeof key, "\"name\":\"%s\"", name);
    FILE *f = fopen(path, "r");
    int n = 0;
    if (!f) return -1;
    while (fgets(line, sizeof line, f)) n += strstr(line, key) != NULL && strstr(line, "\"ph\":\"X\"") != NULL;
    fclose(f);
    return n;
}

/* On one rank with the default directions the down and dx tiles write the outputs in place: the
 * passes have no combine and no push tasks (mok__plan_in_place); on two ranks they have both. */
MOK_TEST(trace_one_rank_writes_in_place) {
    for (int ranks = 1; ranks <= 2; ++ranks) {
        layer L;
        layer_backend B;
        layer_result got = {0};
        char path[96];
        snprintf(path, sizeof path, "/tmp/mok_test_trace_in_place_%d.json", (int)getpid());
        int ok = traced_layer(&L, &B, ranks, 4, 0, mok_test_seed() + 37);
        if (ok) {
            ok = layer_backend_forward(&B, &L, &got) == MOK_OK && layer_backend_backward(&B, &L, 0, &got) == MOK_OK &&
                 mok_trace_write(B.workspace, path) == MOK_OK;
            CHECK(ok, "%d ranks: passes and trace: %s / %s", ranks, got.message, mok_last_error());
        }
        if (ok) {
            const int dispatch = count_kind(path, "dispatch"), pull = count_kind(path, "pull");
            const int combine = count_kind(path, "combine"), push = count_kind(path, "push");
            CHECK(dispatch > 0 && pull > 0, "%d ranks: %d dispatch and %d pull events", ranks, dispatch, pull);
            if (ranks == 1)
                CHECK(combine == 0 && push == 0, "one rank: %d combine and %d push events", combine, push);
            else
                CHECK(combine == dispatch && push == pull, "two ranks: %d combine, %d push for %d dispatch, %d pull",
                      combine, push, dispatch, pull);
        }
        remove(path);
        layer_result_free(&got);
        layer_backend_close(&B);
        layer_free(&L);
    }
}

/* A GPU CTA's residency event writes its SM cycles (args sm_cycles, from which bench/timeline.py
 * takes the clock); a task event and a residency event without cycles write none. */
MOK_TEST(trace_resident_sm_cycles) {
    const mok_trace_event pass0[3] = {
        {.kind = MOK_TRACE_RESIDENT, .worker = 5, .minibatch = -1, .start_ns = 1000, .end_ns = 111000,
         .cycles = 217800},
        {.kind = MOK_TRACE_RESIDENT, .worker = 6, .minibatch = -1, .start_ns = 1000, .end_ns = 111000},
        {.kind = 0, .worker = 5, .minibatch = 0, .start_ns = 2000, .end_ns = 50000, .cycles = 12345},
    };
    const mok_trace_event *events[MOK_TRACE_PASSES] = {pass0, NULL};
    const int64_t counts[MOK_TRACE_PASSES] = {3, 0};
    char path[96], line[1024];
    snprintf(path, sizeof path, "/tmp/mok_test_trace_cycles_%d.json", (int)getpid());
    CHECK(mok__trace_write_json(path, events, counts, 1) == MOK_OK, "write: %s", mok_last_error());
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "open %s", path);
    int with = 0, resident = 0, tasks = 0, task_cycles = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (strstr(line, "\"cat\":\"resident\"")) {
            ++resident;
            if (strstr(line, "\"tid\":5,")) with += strstr(line, "\"sm_cycles\":217800}") != NULL;
            else with += 10 * (strstr(line, "sm_cycles") != NULL); /* none without cycles */
        } else if (strstr(line, "\"ph\":\"X\"")) {
            ++tasks;
            task_cycles += strstr(line, "sm_cycles") != NULL;
        }
    }
    if (f) fclose(f);
    remove(path);
    CHECK(resident == 2 && with == 1, "%d residency events, cycles written as expected: %d (want 2, 1)", resident,
          with);
    CHECK(tasks == 1 && task_cycles == 0, "%d task events, %d with sm_cycles (want 1, 0)", tasks, task_cycles);
}
