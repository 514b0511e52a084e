/* The counted region of gqakv.tools.work_count: valgrind's callgrind counts only what runs
 * inside gqakv_counted_region (the process runs under --instr-atstart=no, so imports and
 * set-up cost nothing), then writes one dump file per call.
 *
 * Built on demand with the system C compiler; valgrind/callgrind.h ships with valgrind.
 * Outside valgrind the client requests are no-ops and f simply runs. */
#include <valgrind/callgrind.h>

typedef void (*gqakv_region_fn)(void);

void gqakv_counted_region(gqakv_region_fn f)
{
    CALLGRIND_ZERO_STATS;
    CALLGRIND_START_INSTRUMENTATION;
    f();
    CALLGRIND_STOP_INSTRUMENTATION;
    CALLGRIND_DUMP_STATS_AT("gqakv_counted_region");
}
