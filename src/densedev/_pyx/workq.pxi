# Helper pthreads for the scan's parallel phases: each takes the next item by an atomic fetch-add.

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t "pthread_t"
    int pthread_create "pthread_create"(pthread_t *t, const void *attr, void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join "pthread_join"(pthread_t t, void **ret)


cdef extern from "<sched.h>" nogil:
    int sched_yield "sched_yield"()

cdef extern from *:
    """
    static inline Py_ssize_t fetch_add(Py_ssize_t *p) { return __atomic_fetch_add(p, 1, __ATOMIC_RELAXED); }
    static inline void mark_done(int *p) { __atomic_store_n(p, 1, __ATOMIC_RELEASE); }
    static inline int is_done(int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void store_relaxed(Py_ssize_t *p, Py_ssize_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    """
    Py_ssize_t fetch_add(Py_ssize_t *p) nogil
    void mark_done(int *p) nogil
    int is_done(int *p) nogil
    void store_relaxed(Py_ssize_t *p, Py_ssize_t v) nogil


cdef int spawn_helpers(void *(*reader)(void *) noexcept nogil, void *arg, int helpers,
                   pthread_t *threads) noexcept nogil:
    """Start up to ``helpers`` threads running ``reader(arg)``; return how many started."""
    cdef int started = 0, t
    for t in range(helpers):
        if pthread_create(&threads[t], NULL, reader, arg) != 0:
            break
        started += 1
    return started


cdef void join_helpers(pthread_t *threads, int started) noexcept nogil:
    cdef int t
    for t in range(started):
        pthread_join(threads[t], NULL)
