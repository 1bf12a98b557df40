/*
 * Preloaded into QEMU (LD_PRELOAD) when sandlot tracks which guest pages are written: before
 * QEMU's main, it opens a userfaultfd in QEMU's address space with asynchronous
 * write-protection (Linux 6.7+), so the kernel resolves write faults itself and only records
 * them. It does nothing else: sandlot takes the descriptor (pidfd_getfd), registers guest RAM
 * on it and reads and re-arms the written bits through PAGEMAP_SCAN on /proc/PID/pagemap
 * (vmm/write_tracking.py). Any failure leaves QEMU exactly as without it.
 *
 * Acts only in a process named qemu-system-* with SANDLOT_WRITE_TRACKING=1, so the programs of
 * the jail's exec chain that load it too are untouched.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
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

__attribute__((constructor)) static void sandlot_write_tracking(void)
{
    const char *on = getenv("SANDLOT_WRITE_TRACKING");
    if (!on || strcmp(on, "1") != 0)
        return;
    if (strncmp(program_invocation_short_name, "qemu-system-", 12) != 0)
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
