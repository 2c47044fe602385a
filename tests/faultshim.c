/* Fault injection for tests/faults.py: LD_PRELOAD'ed into a command, it makes the k-th
 * write, fsync, rename or file creation under one directory fail with a chosen errno,
 * (only that one: what runs after it, a clean-up, must still work).
 *
 * Counting happens below FAULT_UNDER only (the output's dir), so stderr, pipes and the
 * inputs are never touched. The counters and the fault live in FAULT_STATE, a file of
 * 8 int64s shared by every process of the command (MAP_SHARED):
 *   [0..3] writes, fsyncs, renames, creations seen; [4] the kind to fail (-1: none);
 *   [5] k; [6] errno; [7] failures injected.
 * The libc entry points are interposed, so writers in C, C++ and Rust (torch.save,
 * safetensors) are counted as well as Python's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { WRITE, FSYNC, RENAME, CREATE };

static int64_t *state;
static char under[4096];
static size_t under_len;

__attribute__((constructor)) static void setup(void) {
    const char *u = getenv("FAULT_UNDER"), *s = getenv("FAULT_STATE");
    if (!u || !s || strlen(u) >= sizeof under) return;
    int fd = open(s, O_RDWR | O_CLOEXEC);
    if (fd < 0) return;
    void *m = mmap(NULL, 8 * sizeof(int64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return;
    strcpy(under, u);
    under_len = strlen(under);
    state = m;
}

static int in_dir(const char *path) {
    char buf[8192];
    if (!state || !path) return 0;
    if (path[0] != '/') {
        if (!getcwd(buf, 4096)) return 0;
        size_t n = strlen(buf);
        snprintf(buf + n, sizeof buf - n, "/%s", path);
        path = buf;
    }
    return strncmp(path, under, under_len) == 0 && (path[under_len] == '/' || path[under_len] == 0);
}

static int fd_in_dir(int fd) {
    char link[64], path[4096];
    if (!state || fd < 3) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return in_dir(path);
}

static int at_in_dir(int dirfd, const char *path) {
    char buf[8192], dir[4096];
    if (!state || !path) return 0;
    if (path[0] == '/' || dirfd == AT_FDCWD) return in_dir(path);
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
    ssize_t n = readlink(link, dir, sizeof dir - 1);
    if (n <= 0) return 0;
    dir[n] = 0;
    snprintf(buf, sizeof buf, "%s/%s", dir, path);
    return in_dir(buf);
}

/* whether this event (already known to be under the dir) fails */
static int fails(int kind) {
    int64_t n = __atomic_add_fetch(&state[kind], 1, __ATOMIC_SEQ_CST);
    if (state[4] == kind && n == state[5]) {
        __atomic_add_fetch(&state[7], 1, __ATOMIC_SEQ_CST);
        errno = (int)state[6];
        return 1;
    }
    return 0;
}

#define REAL(name) static __typeof__(name) *real_##name; \
    if (!real_##name) real_##name = (__typeof__(name) *)dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *b, size_t n) {
    REAL(write);
    if (fd_in_dir(fd) && fails(WRITE)) return -1;
    return real_write(fd, b, n);
}
ssize_t writev(int fd, const struct iovec *v, int c) {
    REAL(writev);
    if (fd_in_dir(fd) && fails(WRITE)) return -1;
    return real_writev(fd, v, c);
}
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) {
    REAL(pwrite);
    if (fd_in_dir(fd) && fails(WRITE)) return -1;
    return real_pwrite(fd, b, n, o);
}
ssize_t pwrite64(int fd, const void *b, size_t n, off64_t o) {
    REAL(pwrite64);
    if (fd_in_dir(fd) && fails(WRITE)) return -1;
    return real_pwrite64(fd, b, n, o);
}
ssize_t sendfile(int out, int in, off_t *o, size_t n) {
    REAL(sendfile);
    if (fd_in_dir(out) && fails(WRITE)) return -1;
    return real_sendfile(out, in, o, n);
}
ssize_t sendfile64(int out, int in, off64_t *o, size_t n) {
    REAL(sendfile64);
    if (fd_in_dir(out) && fails(WRITE)) return -1;
    return real_sendfile64(out, in, o, n);
}
ssize_t copy_file_range(int in, off64_t *oi, int out, off64_t *oo, size_t n, unsigned f) {
    REAL(copy_file_range);
    if (fd_in_dir(out) && fails(WRITE)) return -1;
    return real_copy_file_range(in, oi, out, oo, n, f);
}
int fsync(int fd) {
    REAL(fsync);
    if (fd_in_dir(fd) && fails(FSYNC)) return -1;
    return real_fsync(fd);
}
int fdatasync(int fd) {
    REAL(fdatasync);
    if (fd_in_dir(fd) && fails(FSYNC)) return -1;
    return real_fdatasync(fd);
}
int rename(const char *a, const char *b) {
    REAL(rename);
    if ((in_dir(a) || in_dir(b)) && fails(RENAME)) return -1;
    return real_rename(a, b);
}
int renameat(int da, const char *a, int db, const char *b) {
    REAL(renameat);
    if ((at_in_dir(da, a) || at_in_dir(db, b)) && fails(RENAME)) return -1;
    return real_renameat(da, a, db, b);
}
int renameat2(int da, const char *a, int db, const char *b, unsigned f) {
    REAL(renameat2);
    if ((at_in_dir(da, a) || at_in_dir(db, b)) && fails(RENAME)) return -1;
    return real_renameat2(da, a, db, b, f);
}
/* a creation is a name that does not exist yet (makedirs' mkdir of an existing dir is none) */
static int new_name(int d, const char *p) { return faccessat(d, p, F_OK, AT_SYMLINK_NOFOLLOW) != 0; }

int mkdir(const char *p, mode_t m) {
    REAL(mkdir);
    if (in_dir(p) && new_name(AT_FDCWD, p) && fails(CREATE)) return -1;
    return real_mkdir(p, m);
}
int mkdirat(int d, const char *p, mode_t m) {
    REAL(mkdirat);
    if (at_in_dir(d, p) && new_name(d, p) && fails(CREATE)) return -1;
    return real_mkdirat(d, p, m);
}

#define OPEN_MODE(flags) mode_t mode = 0; if ((flags) & (O_CREAT | __O_TMPFILE)) { \
    va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }
#define CREATES(flags) ((flags) & (O_CREAT | __O_TMPFILE))
#define NEW(d, p) new_name(d, p)

int open(const char *p, int flags, ...) {
    REAL(open);
    OPEN_MODE(flags);
    if (CREATES(flags) && in_dir(p) && NEW(AT_FDCWD, p) && fails(CREATE)) return -1;
    return real_open(p, flags, mode);
}
int open64(const char *p, int flags, ...) {
    REAL(open64);
    OPEN_MODE(flags);
    if (CREATES(flags) && in_dir(p) && NEW(AT_FDCWD, p) && fails(CREATE)) return -1;
    return real_open64(p, flags, mode);
}
int openat(int d, const char *p, int flags, ...) {
    REAL(openat);
    OPEN_MODE(flags);
    if (CREATES(flags) && at_in_dir(d, p) && NEW(d, p) && fails(CREATE)) return -1;
    return real_openat(d, p, flags, mode);
}
int openat64(int d, const char *p, int flags, ...) {
    REAL(openat64);
    OPEN_MODE(flags);
    if (CREATES(flags) && at_in_dir(d, p) && NEW(d, p) && fails(CREATE)) return -1;
    return real_openat64(d, p, flags, mode);
}
