/*
 * Preloaded into QEMU (LD_PRELOAD) by sandlot, for two jobs, each off unless QEMU's environment
 * asks for it, and each acting only in a process named qemu-system-* (the programs of the
 * jail's exec chain load it too, untouched):
 *
 * SANDLOT_WRITE_TRACKING=1: before QEMU's main, it opens a userfaultfd in QEMU's address space
 * with asynchronous write-protection (Linux 6.7+), so the kernel resolves write faults itself
 * and only records them. Sandlot takes the descriptor (pidfd_getfd), registers guest RAM on it
 * and reads and re-arms the written bits through PAGEMAP_SCAN on /proc/PID/pagemap
 * (vmm/write_tracking.py). Any failure leaves QEMU exactly as without it.
 *
 * SANDLOT_RAM_NO_HUGEPAGE=1: QEMU's madvise(MADV_HUGEPAGE) on guest RAM is skipped. The guest
 * RAM of a lazily restored VM is a file served on demand (storage/lazyfs.py); on a mapping so
 * advised, Linux reads 4 MiB around every page fault (two huge pages' worth, even where the
 * file cannot have huge pages), so each page the guest touches fetches 64 chunks from the
 * store. Without the advice a fault reads the file's usual read-around (128 KiB).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SANDLOT_UFFD_API 0xAAULL
#define SANDLOT_UFFD_USER_MODE_ONLY 1
#define SANDLOT_UFFD_FEATURE_WP_ASYNC (1ULL << 15)
#define SANDLOT_UFFDIO_API 0xc018aa3fUL /* _IOWR(0xAA, 0x3F, struct uffdio_api) */

struct sandlot_uffdio_api {
    uint64_t api;
    uint64_t features;
    uint64_t ioctls;
};

extern char *program_invocation_short_name;

static int sandlot_in_qemu(void)
{
    return strncmp(program_invocation_short_name, "qemu-system-", 12) == 0;
}

__attribute__((constructor)) static void sandlot_write_tracking(void)
{
    const char *on = getenv("SANDLOT_WRITE_TRACKING");
    if (!on || strcmp(on, "1") != 0)
        return;
    if (!sandlot_in_qemu())
        return;
    int saved = errno;
    int fd = (int)syscall(SYS_userfaultfd,
                          O_CLOEXEC | O_NONBLOCK | SANDLOT_UFFD_USER_MODE_ONLY);
    if (fd >= 0) {
        struct sandlot_uffdio_api api = {SANDLOT_UFFD_API, SANDLOT_UFFD_FEATURE_WP_ASYNC, 0};
        if (ioctl(fd, SANDLOT_UFFDIO_API, &api) != 0)
            close(fd);
    }
    errno = saved;
}

int madvise(void *addr, size_t length, int advice)
{
    static int (*next)(void *, size_t, int);
    if (!next)
        next = (int (*)(void *, size_t, int))dlsym(RTLD_NEXT, "madvise");
    if (advice == MADV_HUGEPAGE && sandlot_in_qemu()) {
        const char *skip = getenv("SANDLOT_RAM_NO_HUGEPAGE");
        if (skip && strcmp(skip, "1") == 0)
            return 0;
    }
    if (!next) {
        errno = ENOSYS;
        return -1;
    }
    return next(addr, length, advice);
}
