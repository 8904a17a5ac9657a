# One work queue for every parallel phase of the scan: n independent items (directories to list, links
# to read, class maps to sort, VFs to read) taken one at a time, with an atomic fetch-add, by this
# thread and up to MAX_HELPERS pthreads, so whoever is free takes the next.  The scan is
# syscall-bound and syscalls on different files scale across cores (path walks are RCU lookups, no
# shared lock).  A consumer that needs the items in order waits for item k through per-item done
# flags, stored with release and loaded with acquire, so what the item's reader wrote is visible
# once its flag is.

from libc.string cimport memset

# Helper threads a scan may start beside its own: one fewer than the cores (more would only queue).
_HELPERS = max(0, min(MAX_HELPERS, (_os.cpu_count() or 1) - 1))


cdef int gated(int helpers, int *gate) noexcept nogil:
    """``helpers`` once the fd ``*gate`` is readable (or when it is -1), none while it is not.

    The child reading the daemon's first scan (node.ahead) shares the cores with the daemon's imports:
    helpers would only slow those down until the daemon waits for the scan, and then they are all it
    waits for.  Its gate is a pipe the daemon closes as it starts waiting (poll reports the end of
    file as readable); each parallel phase asks at its start, and the long ones come in batches (VFs
    512 at a time, class links 4,096), so helpers join within a few ms.  Once open (or an fd gone
    bad), for good: -1.
    """
    cdef pollfd p
    if gate[0] < 0 or helpers == 0:
        return helpers
    p.fd = gate[0]
    p.events = POLLIN
    p.revents = 0
    if poll(&p, 1, 0) == 0:
        return 0
    gate[0] = -1
    return helpers


cdef void workq_init(workq *q, work_fn run, void *ctx, Py_ssize_t n, int *done) noexcept nogil:
    """Set up ``n`` items of ``ctx`` for ``run``; ``done`` (n flags, or NULL) is cleared."""
    q.run = run
    q.ctx = ctx
    q.n = n
    q.next = 0
    q.done = done
    q.started = 0
    if done != NULL and n > 0:
        memset(done, 0, n * sizeof(int))


cdef bint workq_take(workq *q) noexcept nogil:
    """Do the next item nobody has taken; False when none is left."""
    cdef Py_ssize_t i = fetch_add(&q.next)
    if i >= q.n:
        return False
    q.run(q.ctx, i)
    if q.done != NULL:
        mark_done(&q.done[i])
    return True


cdef void *workq_helper(void *arg) noexcept nogil:
    while workq_take(<workq *>arg):
        pass
    return NULL


cdef void workq_start(workq *q, int helpers) noexcept nogil:
    """Start up to ``helpers`` threads taking items (never more than the items after this thread's)."""
    cdef int t
    if helpers > MAX_HELPERS:
        helpers = MAX_HELPERS
    if helpers > q.n - 1:
        helpers = <int>(q.n - 1)
    for t in range(helpers):
        # One that will not start leaves its share to the rest: every item is taken by someone.
        if pthread_create(&q.threads[q.started], NULL, workq_helper, q) != 0:
            break
        q.started += 1


cdef void workq_wait(workq *q, Py_ssize_t k) noexcept nogil:
    """Until item k is done (needs done flags): take items while any are left, then wait for the helpers'."""
    while not is_done(&q.done[k]):
        if not workq_take(q):
            sched_yield()


cdef void workq_stop(workq *q) noexcept nogil:
    """Let nobody take another item and join the helpers, each after the item it has."""
    cdef int t
    store_relaxed(&q.next, q.n)
    for t in range(q.started):
        pthread_join(q.threads[t], NULL)
    q.started = 0


cdef void workq_run(workq *q, int helpers) noexcept nogil:
    """Do every item, this thread and up to ``helpers`` more taking the next one each."""
    workq_start(q, helpers)
    while workq_take(q):
        pass
    workq_stop(q)
