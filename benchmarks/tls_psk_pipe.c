/* One loopback transfer between two threads of this process, over raw TCP or TLS 1.3 with an
 * external pre-shared key (OpenSSL's libssl), for benchmarks/bench_tls_psk.py, which compiles it.
 *
 *   tls_psk_pipe MODE CIPHER NBYTES CHUNK [SRC DST]
 *
 * MODE: raw (send()/recv()), tls (SSL_write()/SSL_read() in user space) or ktls (the same session
 * with SSL_OP_ENABLE_KTLS, and SSL_sendfile() from SRC where the kernel took the send side).
 * CIPHER: aes256 (TLS_AES_256_GCM_SHA384) or aes128 (TLS_AES_128_GCM_SHA256); ignored for raw.
 * Without SRC/DST the sender sends one CHUNK-byte buffer over and over and the receiver reads into
 * one CHUNK-byte buffer (the shape of raw TCP in benchmarks/references.py). With them the sender
 * pread()s each chunk of SRC into its buffer (or sendfile()s it) and the receiver reads straight
 * into a shared mapping of DST, which must already be NBYTES long (a steady push's spare); the
 * mapping is faulted in before the timer starts, as a steady push's kept mapping is.
 *
 * Prints one JSON object: seconds from the sender's first byte to the receiver's last (the
 * handshake is timed apart), and each thread's CPU time (CLOCK_THREAD_CPUTIME_ID, with getrusage's
 * user/system split) from the handshake's end to its last byte. Exits 1 with a message on stderr on any failure. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char IDENTITY[] = "rank-0->rank-1";
static unsigned char psk_key[32];
static int mode_tls, mode_ktls;
static const char *suite_name;
static unsigned char suite_id[2];
static size_t nbytes, chunk;
static const char *src_path, *dst_path;

struct end_result {
  double start, end, cpu, user, sys, handshake;
  int ktls_send, ktls_recv, psk_used;
  char version[16], cipher[64];
};

static void die(const char *what) {
  fprintf(stderr, "tls_psk_pipe: %s: %s\n", what, errno ? strerror(errno) : "");
  ERR_print_errors_fp(stderr);
  exit(1);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The thread's CPU time (the scheduler's exact runtime) and its user/system split (getrusage,
 * which a tick-accounting kernel rounds: small transfers can read 0 there). */
static void thread_cpu(double *cpu, double *user, double *sys) {
  struct timespec ts;
  struct rusage ru;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0 || getrusage(RUSAGE_THREAD, &ru) != 0) die("thread CPU time");
  *cpu = ts.tv_sec + ts.tv_nsec * 1e-9;
  *user = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6;
  *sys = ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static void thread_cpu_since(struct end_result *r, double c0, double u0, double s0) {
  thread_cpu(&r->cpu, &r->user, &r->sys);
  r->cpu -= c0;
  r->user -= u0;
  r->sys -= s0;
}

/* The session that carries the external PSK: same key, identity and suite on both ends. */
static SSL_SESSION *psk_session(SSL *ssl) {
  const SSL_CIPHER *cipher = SSL_CIPHER_find(ssl, suite_id);
  SSL_SESSION *session = SSL_SESSION_new();
  if (cipher == NULL || session == NULL || !SSL_SESSION_set1_master_key(session, psk_key, sizeof psk_key) ||
      !SSL_SESSION_set_cipher(session, cipher) || !SSL_SESSION_set_protocol_version(session, TLS1_3_VERSION))
    die("building the PSK session");
  return session;
}

static int use_psk(SSL *ssl, const EVP_MD *md, const unsigned char **id, size_t *idlen, SSL_SESSION **sess) {
  (void)md;
  *sess = psk_session(ssl);
  *id = (const unsigned char *)IDENTITY;
  *idlen = sizeof IDENTITY - 1;
  return 1;
}

static int find_psk(SSL *ssl, const unsigned char *id, size_t idlen, SSL_SESSION **sess) {
  if (idlen != sizeof IDENTITY - 1 || memcmp(id, IDENTITY, idlen) != 0) {
    *sess = NULL; /* unknown identity: no PSK, and without a certificate the handshake fails */
    return 1;
  }
  *sess = psk_session(ssl);
  return 1;
}

static SSL *tls_on(int fd, int server) {
  SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == NULL || !SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) ||
      !SSL_CTX_set_ciphersuites(ctx, suite_name))
    die("SSL_CTX");
  SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET | (mode_ktls ? SSL_OP_ENABLE_KTLS : 0));
  if (server)
    SSL_CTX_set_psk_find_session_callback(ctx, find_psk);
  else
    SSL_CTX_set_psk_use_session_callback(ctx, use_psk);
  SSL *ssl = SSL_new(ctx);
  SSL_CTX_free(ctx); /* the SSL keeps its reference */
  if (ssl == NULL || !SSL_set_fd(ssl, fd)) die("SSL_new");
  if ((server ? SSL_accept(ssl) : SSL_connect(ssl)) != 1) die("TLS handshake");
  return ssl;
}

static void describe(SSL *ssl, struct end_result *r) {
  snprintf(r->version, sizeof r->version, "%s", SSL_get_version(ssl));
  snprintf(r->cipher, sizeof r->cipher, "%s", SSL_CIPHER_get_name(SSL_get_current_cipher(ssl)));
  r->psk_used = SSL_session_reused(ssl);
  r->ktls_send = BIO_get_ktls_send(SSL_get_wbio(ssl)) ? 1 : 0;
  r->ktls_recv = BIO_get_ktls_recv(SSL_get_rbio(ssl)) ? 1 : 0;
}

/* Sends (sending) or receives exactly n bytes at p, over TLS where ssl is set. */
static void move_all(SSL *ssl, int fd, unsigned char *p, size_t n, int sending) {
  while (n > 0) {
    size_t moved = 0;
    long got;
    if (ssl)
      got = (sending ? SSL_write_ex(ssl, p, n, &moved) : SSL_read_ex(ssl, p, n, &moved)) ? (long)moved : -1;
    else
      got = sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, MSG_WAITALL);
    if (got <= 0) die(sending ? "sending" : "receiving");
    p += got;
    n -= (size_t)got;
  }
}

static int listen_fd, client_fd;
static struct sockaddr_in addr;

static void *receiver(void *arg) {
  struct end_result *r = arg;
  double t0 = now();
  int fd = accept(listen_fd, NULL, NULL);
  if (fd < 0) die("accept");
  SSL *ssl = mode_tls ? tls_on(fd, 1) : NULL;
  if (ssl) describe(ssl, r);
  r->handshake = now() - t0;
  unsigned char *out = NULL;
  int map_fd = -1;
  if (dst_path) {
    map_fd = open(dst_path, O_RDWR | O_CLOEXEC);
    if (map_fd < 0) die("open DST");
    out = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, map_fd, 0); /* faulted in untimed */
    if (out == MAP_FAILED) die("mmap DST");
  } else if ((out = malloc(chunk)) == NULL) {
    die("malloc");
  }
  double c0, u0, s0;
  thread_cpu(&c0, &u0, &s0);
  for (size_t got = 0; got < nbytes;) {
    size_t want = nbytes - got < chunk ? nbytes - got : chunk;
    move_all(ssl, fd, dst_path ? out + got : out, want, 0);
    got += want;
  }
  r->end = now();
  thread_cpu_since(r, c0, u0, s0);
  if (ssl) SSL_free(ssl);
  close(fd);
  if (dst_path) munmap(out, nbytes), close(map_fd);
  else free(out);
  return NULL;
}

static void sender(struct end_result *r) {
  double t0 = now();
  int one = 1;
  if (connect(client_fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
      setsockopt(client_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
    die("connect");
  SSL *ssl = mode_tls ? tls_on(client_fd, 0) : NULL;
  if (ssl) describe(ssl, r);
  r->handshake = now() - t0;
  int src = -1;
  if (src_path && (src = open(src_path, O_RDONLY | O_CLOEXEC)) < 0) die("open SRC");
  unsigned char *buf = malloc(chunk);
  if (buf == NULL) die("malloc");
  memset(buf, 0x5a, chunk);
  double c0, u0, s0;
  thread_cpu(&c0, &u0, &s0);
  r->start = now();
  for (size_t done = 0; done < nbytes;) {
    size_t n = nbytes - done < chunk ? nbytes - done : chunk;
    if (ssl && r->ktls_send && src >= 0) {
      ossl_ssize_t sent = SSL_sendfile(ssl, src, (off_t)done, n, 0);
      if (sent <= 0) die("SSL_sendfile");
      n = (size_t)sent;
    } else {
      if (src >= 0 && pread(src, buf, n, (off_t)done) != (ssize_t)n) die("pread SRC");
      move_all(ssl, client_fd, buf, n, 1);
    }
    done += n;
  }
  thread_cpu_since(r, c0, u0, s0);
  if (ssl) SSL_shutdown(ssl), SSL_free(ssl);
  if (src >= 0) close(src);
  free(buf);
}

static void print_end(const char *name, const struct end_result *r) {
  printf("\"%s\": {\"cpu_s\": %.6f, \"user_s\": %.6f, \"sys_s\": %.6f, \"handshake_s\": %.6f, "
         "\"version\": \"%s\", \"cipher\": \"%s\", \"psk_used\": %s, \"ktls_send\": %s, \"ktls_recv\": %s}",
         name, r->cpu, r->user, r->sys, r->handshake, r->version, r->cipher, r->psk_used ? "true" : "false",
         r->ktls_send ? "true" : "false", r->ktls_recv ? "true" : "false");
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 7) {
    fprintf(stderr, "usage: %s raw|tls|ktls aes256|aes128 NBYTES CHUNK [SRC DST]\n", argv[0]);
    return 2;
  }
  mode_tls = strcmp(argv[1], "raw") != 0;
  mode_ktls = strcmp(argv[1], "ktls") == 0;
  if (mode_tls && !mode_ktls && strcmp(argv[1], "tls") != 0) return fprintf(stderr, "bad mode\n"), 2;
  if (strcmp(argv[2], "aes256") == 0) {
    suite_name = "TLS_AES_256_GCM_SHA384", suite_id[0] = 0x13, suite_id[1] = 0x02;
  } else if (strcmp(argv[2], "aes128") == 0) {
    suite_name = "TLS_AES_128_GCM_SHA256", suite_id[0] = 0x13, suite_id[1] = 0x01;
  } else {
    return fprintf(stderr, "bad cipher\n"), 2;
  }
  nbytes = strtoull(argv[3], NULL, 10);
  chunk = strtoull(argv[4], NULL, 10);
  if (nbytes == 0 || chunk == 0) return fprintf(stderr, "NBYTES and CHUNK must be positive\n"), 2;
  if (argc == 7) src_path = argv[5], dst_path = argv[6];
  if (RAND_bytes(psk_key, sizeof psk_key) != 1) die("RAND_bytes");

  listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  client_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (listen_fd < 0 || client_fd < 0 || bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
      listen(listen_fd, 1) != 0 || getsockname(listen_fd, (struct sockaddr *)&addr, &len) != 0)
    die("listening socket");

  struct end_result rx = {0}, tx = {0};
  pthread_t thread;
  if (pthread_create(&thread, NULL, receiver, &rx) != 0) die("pthread_create");
  sender(&tx);
  pthread_join(thread, NULL);
  double seconds = rx.end - tx.start;
  printf("{\"mode\": \"%s\", \"cipher\": \"%s\", \"nbytes\": %zu, \"chunk\": %zu, \"files\": %s, "
         "\"seconds\": %.6f, \"gb_per_s\": %.4f, \"openssl\": \"%s\", ",
         argv[1], mode_tls ? suite_name : "none", nbytes, chunk, src_path ? "true" : "false", seconds,
         nbytes / seconds / 1e9, OpenSSL_version(OPENSSL_VERSION));
  print_end("sender", &tx);
  printf(", ");
  print_end("receiver", &rx);
  printf("}\n");
  return 0;
}
