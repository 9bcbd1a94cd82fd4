// statfloor: the least work of an unchanged re-stage, as the yardstick for berth's: every entry
// under SRC lstat()ed and, with DST, the entry of the same path there too, by THREADS threads
// sharing a queue of directories. No allocation per entry, no sorting, no comparison: what is
// left is the kernel's share, which no implementation avoids.
// Prints "ENTRIES MILLISECONDS". Usage: statfloor THREADS SRC [DST]
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *src, *dst;
static char **queue;
static size_t queued, cap;
static long pending;  // directories queued or being read
static long entries;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

static void die(const char *what, const char *path) {
  fprintf(stderr, "statfloor: %s %s: %m\n", what, path);
  exit(1);
}

static void push(char *rel) {
  pthread_mutex_lock(&mu);
  if (queued == cap) {
    cap = cap ? cap * 2 : 1024;
    queue = realloc(queue, cap * sizeof *queue);
    if (!queue) die("realloc", "queue");
  }
  queue[queued++] = rel;
  pending++;
  pthread_cond_signal(&cv);
  pthread_mutex_unlock(&mu);
}

static void list(const char *rel) {
  char path[8192];
  snprintf(path, sizeof path, "%s/%s", src, rel);
  DIR *d = opendir(path);
  if (!d) die("opendir", path);
  int dfd = -1;
  if (dst) {
    snprintf(path, sizeof path, "%s/%s", dst, rel);
    dfd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
  }
  long n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW)) die("lstat", e->d_name);
    struct stat dst_st;
    if (dfd >= 0) fstatat(dfd, e->d_name, &dst_st, AT_SYMLINK_NOFOLLOW);
    n++;
    if (S_ISDIR(st.st_mode)) {
      char *child = malloc(strlen(rel) + strlen(e->d_name) + 2);
      if (!child) die("malloc", e->d_name);
      sprintf(child, "%s/%s", rel, e->d_name);
      push(child);
    }
  }
  closedir(d);
  if (dfd >= 0) close(dfd);
  __atomic_fetch_add(&entries, n, __ATOMIC_RELAXED);
}

static void *worker(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&mu);
    while (!queued && pending) pthread_cond_wait(&cv, &mu);
    if (!queued) {
      pthread_cond_broadcast(&cv);
      pthread_mutex_unlock(&mu);
      return NULL;
    }
    char *rel = queue[--queued];
    pthread_mutex_unlock(&mu);
    list(rel);
    free(rel);
    pthread_mutex_lock(&mu);
    if (!--pending) pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
  }
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: statfloor THREADS SRC [DST]\n");
    return 2;
  }
  int threads = atoi(argv[1]);
  if (threads < 1 || threads > 1024) threads = 1;
  src = argv[2];
  dst = argc > 3 ? argv[3] : NULL;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  push(strdup("."));
  pthread_t th[1024];
  for (int i = 0; i < threads; i++) pthread_create(&th[i], NULL, worker, NULL);
  for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("%ld %.1f\n", entries, (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
  return 0;
}
