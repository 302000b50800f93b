/* bind() shim for transfer-engine processes (LD_PRELOAD).
 *
 * The stock Mooncake transfer engine binds its TCP acceptor and its P2P
 * handshake listener to the wildcard address; MC_TCP_BIND_ADDRESS changes only
 * the address it advertises. Any peer that reaches those ports can read and
 * write the process's memory, so they must listen on the cluster's own
 * address only. This shim rewrites every wildcard bind (0.0.0.0, ::) of the
 * process to KVPOOL_BIND_ADDRESS; an IPv4 address is bound as ::ffff:a.b.c.d on
 * IPv6 sockets. A wildcard bind it cannot rewrite (an IPv4 socket while the
 * address is IPv6) fails with EADDRNOTAVAIL: fail closed, never wide open.
 * Without KVPOOL_BIND_ADDRESS every bind passes through unchanged.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;
static struct in_addr bind_v4;
static struct in6_addr bind_v6;
static int have_v4, have_v6;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* read by kvpool.bind_shim: the shim is loaded, and how many binds it rewrote */
const int kvpool_bind_shim_version = 1;
unsigned long kvpool_bind_shim_rewrites;

static void init(void) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *address = getenv("KVPOOL_BIND_ADDRESS");
    if (address == NULL || *address == '\0')
        return;
    if (inet_pton(AF_INET, address, &bind_v4) == 1) {
        have_v4 = 1;
        memset(&bind_v6, 0, sizeof bind_v6);
        bind_v6.s6_addr[10] = 0xff;
        bind_v6.s6_addr[11] = 0xff;
        memcpy(&bind_v6.s6_addr[12], &bind_v4, 4);
        have_v6 = 1;
    } else if (inet_pton(AF_INET6, address, &bind_v6) == 1) {
        have_v6 = 1;
    } else {
        /* unparsable: refuse every wildcard bind rather than open one */
        have_v4 = have_v6 = 0;
        bind_v4.s_addr = htonl(INADDR_NONE);
    }
}

static int configured(void) {
    const char *address = getenv("KVPOOL_BIND_ADDRESS");
    return address != NULL && *address != '\0';
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    pthread_once(&once, init);
    if (real_bind == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (addr == NULL || !configured())
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr != htonl(INADDR_ANY))
            return real_bind(fd, addr, len);
        if (!have_v4) {
            errno = EADDRNOTAVAIL;
            return -1;
        }
        in4.sin_addr = bind_v4;
        __atomic_add_fetch(&kvpool_bind_shim_rewrites, 1, __ATOMIC_RELAXED);
        return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (!IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr))
            return real_bind(fd, addr, len);
        if (!have_v6) {
            errno = EADDRNOTAVAIL;
            return -1;
        }
        in6.sin6_addr = bind_v6;
        __atomic_add_fetch(&kvpool_bind_shim_rewrites, 1, __ATOMIC_RELAXED);
        return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
    }
    return real_bind(fd, addr, len);
}
