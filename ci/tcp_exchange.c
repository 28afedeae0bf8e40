/* Two processes, on CPUs 0 and 1, swap N bytes each way over loopback TCP,
 * ITERS times: over one socket carrying both directions, or over a socket
 * per direction. What the TCP transport's lanes rest on (see
 * transport/src/tcp/connection.rs).
 *
 *   gcc -O2 -o /tmp/tcp_exchange ci/tcp_exchange.c
 *   /tmp/tcp_exchange N PIECE SOCKETS ITERS    (SOCKETS: 1 or 2)
 *   e.g. for s in 1 2 1 2; do /tmp/tcp_exchange 2097152 4194304 $s 300; done
 *
 * Each side sends at most PIECE bytes a call and receives what has come,
 * non-blocking, spinning, as the transport does; prints the mean time of
 * one exchange. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cpu.h"

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s N PIECE SOCKETS ITERS\n", argv[0]);
        return 2;
    }
    size_t n = strtoul(argv[1], 0, 10), piece = strtoul(argv[2], 0, 10);
    int sockets = atoi(argv[3]), iters = atoi(argv[4]), warmup = 20;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(listener, (void *)&addr, len) || listen(listener, 4) ||
        getsockname(listener, (void *)&addr, &len)) {
        perror("listen");
        return 1;
    }
    int child = fork() == 0;
    pin(child);
    int s[2];
    for (int i = 0; i < sockets; i++) {
        if (child) {
            s[i] = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(s[i], (void *)&addr, sizeof addr)) {
                perror("connect");
                return 1;
            }
        } else {
            s[i] = accept(listener, 0, 0);
        }
        int one = 1;
        setsockopt(s[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(s[i], F_SETFL, O_NONBLOCK);
    }
    if (sockets == 1) s[1] = s[0];
    /* The parent sends on the first socket, the child on the second. */
    int tx = child ? s[1] : s[0], rx = child ? s[0] : s[1];
    char *out = malloc(n), *in = malloc(n);
    memset(out, 1, n);
    memset(in, 0, n);
    double start = 0;
    for (int it = 0; it < warmup + iters; it++) {
        if (it == warmup) start = now_us();
        size_t sent = 0, got = 0;
        while (sent < n || got < n) {
            if (sent < n) {
                size_t k = n - sent < piece ? n - sent : piece;
                ssize_t r = send(tx, out + sent, k, MSG_NOSIGNAL);
                if (r > 0) sent += r;
            }
            if (got < n) {
                ssize_t r = recv(rx, in + got, n - got, 0);
                if (r > 0) got += r;
                if (r == 0) {
                    fprintf(stderr, "peer closed\n");
                    return 1;
                }
            }
        }
    }
    double per = (now_us() - start) / iters;
    if (child) {
        printf("%zu B each way, pieces of %zu, %d socket(s): %.1f us an exchange, %.2f GB/s each way\n",
               n, piece, sockets, per, n / per / 1e3);
    } else {
        wait(0);
    }
    return 0;
}
