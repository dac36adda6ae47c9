/* progress.c — progress.h. The line being built is kept whole, so that on a terminal the ticker
 * can redraw it with the running pass's time after it ("\r", the line, the tick, clear to the end),
 * and a completed pass redraws it without the tick. Elsewhere (a file, a pipe) each completed
 * pass is written as it comes and flushed, and nothing is ever redrawn. */
#include "progress.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* A pass shows its tick only after running this long: short passes stay quiet. */
#define TICK_AFTER_SECONDS 1.0

struct tools_progress {
    FILE *out;
    int terminal;
    double start;
    pthread_mutex_t lock;  /* guards everything below */
    pthread_t ticker;
    int ticker_running;
    int stopping;
    char line[512];        /* the line so far */
    int passes;            /* passes on it */
    const char *pass;      /* the running pass; NULL between passes */
    double pass_start;
    int ticked;            /* a tick is drawn after the line */
};

double tools_now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void append(tools_progress *p, const char *text) {
    size_t used = strlen(p->line);
    snprintf(p->line + used, sizeof p->line - used, "%s", text);
}

/* Redraws the line, with the running pass's tick when it has run long enough. Lock held. */
static void redraw(tools_progress *p) {
    double running = p->pass ? tools_now_seconds() - p->pass_start : 0.0;
    if (p->pass && running >= TICK_AFTER_SECONDS) {
        fprintf(p->out, "\r%s  %s running, %.0f s\033[K", p->line, p->pass, running);
        p->ticked = 1;
    } else if (p->ticked) {
        fprintf(p->out, "\r%s\033[K", p->line);
        p->ticked = 0;
    }
    fflush(p->out);
}

static void *tick(void *arg) {
    tools_progress *p = arg;
    struct timespec quarter = {0, 250 * 1000 * 1000};
    for (;;) {
        nanosleep(&quarter, NULL);
        pthread_mutex_lock(&p->lock);
        int stop = p->stopping;
        if (!stop && p->pass) redraw(p);
        pthread_mutex_unlock(&p->lock);
        if (stop) return NULL;
    }
}

tools_progress *tools_progress_start(FILE *out) {
    tools_progress *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->out = out;
    p->terminal = isatty(fileno(out));
    p->start = tools_now_seconds();
    pthread_mutex_init(&p->lock, NULL);
    if (p->terminal) p->ticker_running = pthread_create(&p->ticker, NULL, tick, p) == 0;
    return p;
}

void tools_progress_stop(tools_progress *p) {
    if (!p) return;
    if (p->ticker_running) {
        pthread_mutex_lock(&p->lock);
        p->stopping = 1;
        pthread_mutex_unlock(&p->lock);
        pthread_join(p->ticker, NULL);
    }
    pthread_mutex_destroy(&p->lock);
    free(p);
}

void tools_progress_line(tools_progress *p, const char *label) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    snprintf(p->line, sizeof p->line, "%-9s", label);
    p->passes = 0;
    fputs(p->line, p->out);
    fflush(p->out);
    pthread_mutex_unlock(&p->lock);
}

void tools_progress_pass(tools_progress *p, const char *pass) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->pass = pass;
    p->pass_start = tools_now_seconds();
    pthread_mutex_unlock(&p->lock);
}

void tools_progress_done(tools_progress *p, double seconds) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    char text[96];
    snprintf(text, sizeof text, "%s%s %.3f s", p->passes++ ? ", " : " ", p->pass ? p->pass : "pass", seconds);
    append(p, text);
    p->pass = NULL;
    if (p->ticked) redraw(p); /* the line without its tick, the new pass included */
    else fputs(text, p->out);
    fflush(p->out);
    pthread_mutex_unlock(&p->lock);
}

void tools_progress_end_line(tools_progress *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->pass = NULL;
    if (p->ticked) redraw(p);
    fprintf(p->out, "   (elapsed %.1f s)\n", tools_now_seconds() - p->start);
    fflush(p->out);
    p->line[0] = '\0';
    pthread_mutex_unlock(&p->lock);
}
