/* tasks_dump.c — prints the task list of a one-rank pass, one task per line: kind role wait0
 * target0 wait1 target1 done0 done1 (core/tasks.h) and the real rows of the task's routed row tile
 * (gate/up, down, dh, dx; 0 for other kinds), for scripts/sim_pass.py. ROWS gives every local
 * expert's routed rows: one number for all of them, or E numbers separated by commas.
 *
 *   tasks_dump E ROWS H I I_S T RING_ROWS MINIBATCH_ROWS BACKWARD N_TILE
 *
 * Built by sim_pass.py against build/libmok.a (or with another tasks.inc, to try a branch's order). */
#include <stdio.h>
#include <stdlib.h>

#include "core/tasks.h"
#include "mok.h"

int main(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: tasks_dump E ROWS H I I_S T RING_ROWS MINIBATCH_ROWS BACKWARD N_TILE\n");
        return 2;
    }
    const int E = atoi(argv[1]);
    const char *per = argv[2];
    mok_plan p = {0};
    p.hidden = atoll(argv[3]);
    p.intermediate = atoll(argv[4]);
    p.shared_intermediate = atoll(argv[5]);
    p.num_tokens = atoll(argv[6]);
    p.ring_rows = atoi(argv[7]);
    p.minibatch_rows = atoi(argv[8]);
    p.backward = atoi(argv[9]);
    p.n_tile = atoi(argv[10]);
    p.n_tile_h = 256;
    p.wgrad_tile = 128;
    p.wgrad_tile_n = 256;
    p.raster = 1;
    p.num_local_experts = E;
    p.nranks = 1;
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(E + 1)), *rows = malloc(sizeof(int64_t) * (size_t)E);
    int64_t off = 0;
    for (int e = 0; e < E; ++e) {
        char *end = NULL;
        start[e] = off;
        rows[e] = strtoll(per, &end, 10);
        if (*end == ',') per = end + 1; /* else the last number serves the remaining experts */
        off += (rows[e] + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE;
    }
    start[E] = off;
    p.expert_start = start;
    p.expert_rows = rows;
    p.padded_rows = off;
    p.context_rows = off;
    const int64_t cap = mok__tasks_max(&p, off, p.num_tokens);
    mok_task *t = malloc(sizeof(mok_task) * (size_t)cap);
    const int64_t n = mok__tasks_build(&p, t, cap);
    if (n < 0) {
        fprintf(stderr, "tasks_dump: the list does not fit %lld tasks\n", (long long)cap);
        return 1;
    }
    for (int64_t i = 0; i < n; ++i) {
        const int k = t[i].kind;
        long long real = 0;
        if (k == MOK_TASK_GATEUP || k == MOK_TASK_DOWN || k == MOK_TASK_DH || k == MOK_TASK_DX) {
            const int64_t row0 = (int64_t)t[i].a * MOK_ROW_TILE;
            int e = 0;
            while (e + 1 < E && start[e + 1] <= row0) ++e;
            real = start[e] + rows[e] - row0;
            real = real < 0 ? 0 : real > MOK_ROW_TILE ? MOK_ROW_TILE : real;
        }
        printf("%d %d %d %d %d %d %d %d %lld\n", k, t[i].role, t[i].wait[0], t[i].target[0], t[i].wait[1],
               t[i].target[1], t[i].done[0], t[i].done[1], real);
    }
    free(t);
    free(start);
    free(rows);
    return 0;
}
