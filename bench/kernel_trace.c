/* CUPTI activity records of kind CONCURRENT_KERNEL: the driver timestamps
 * each kernel's start and end, graph kernel nodes included. */
#include "kernel_trace.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef TD_HAVE_CUPTI
#include <cupti.h>

typedef struct krec {
  uint64_t start, end;
  int grid, block;
  uint32_t device;
  char name[56];
} krec;

static krec *recs;
static size_t n_recs, cap_recs;
static bool on;

/* _Z13skinny_kernelILb0ELi5ELi16EEv... -> skinny_kernel<b0,i5,i16> (close enough to tell variants apart) */
static void short_name(const char *m, char *out, size_t cap) {
  if (!m) m = "?";
  size_t o = 0;
  if (m[0] == '_' && m[1] == 'Z') {
    const char *p = m + 2;
    char *e;
    long len = strtol(p, &e, 10);
    if (len > 0 && e != p) {
      for (long i = 0; i < len && e[i] && o + 1 < cap; i++) out[o++] = e[i];
      const char *t = e + len;
      if (*t == 'I' && o + 1 < cap) {
        out[o++] = '<';
        for (t++; *t && *t != 'E' && o + 2 < cap; t++) {
          if (*t == 'L') continue;
          out[o++] = *t;
          if (t[1] == 'E' && t[2] == 'L') {
            out[o++] = ',';
            t++;
          }
        }
        out[o++] = '>';
      }
      out[o] = 0;
      return;
    }
  }
  snprintf(out, cap, "%s", m);
}

static void CUPTIAPI buf_req(uint8_t **buf, size_t *size, size_t *max_recs) {
  *size = (size_t)8 << 20;
  *buf = aligned_alloc(8, *size);
  *max_recs = 0;
}

static void CUPTIAPI buf_done(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *r = NULL;
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (!on || r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
    if (n_recs == cap_recs) {
      size_t nc = cap_recs ? 2 * cap_recs : 4096;
      krec *nr = realloc(recs, nc * sizeof *nr);
      if (!nr) break;
      recs = nr, cap_recs = nc;
    }
    krec *e = &recs[n_recs++];
    e->start = k->start, e->end = k->end;
    e->grid = k->gridX * k->gridY * k->gridZ;
    e->block = k->blockX * k->blockY * k->blockZ;
    e->device = k->deviceId;
    short_name(k->name, e->name, sizeof e->name);
  }
  free(buf);
}

bool td_ktrace_available(void) { return true; }

int td_ktrace_begin(void) {
  static bool registered;
  if (!registered && cuptiActivityRegisterCallbacks(buf_req, buf_done) != CUPTI_SUCCESS) return -1;
  registered = true;
  if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return -1;
  on = true;
  return 0;
}

int td_ktrace_discard(void) {
  cuptiActivityFlushAll(1);
  n_recs = 0;
  return 0;
}

static int by_start(const void *a, const void *b) {
  const krec *x = a, *y = b;
  return x->start < y->start ? -1 : x->start > y->start;
}

typedef struct agg {
  char name[56];
  int n;
  double crit, dur;
} agg;

static int by_crit(const void *a, const void *b) {
  const agg *x = a, *y = b;
  return x->crit > y->crit ? -1 : x->crit < y->crit;
}

int td_ktrace_end(FILE *f, const char *title) { return td_ktrace_end_device(f, title, -1); }

int td_ktrace_end_device(FILE *f, const char *title, int device) {
  cuptiActivityFlushAll(1);
  on = false;
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (device >= 0) { /* the other ranks' GPUs run their own timelines */
    size_t k = 0;
    for (size_t i = 0; i < n_recs; i++)
      if (recs[i].device == (uint32_t)device) recs[k++] = recs[i];
    n_recs = k;
  }
  if (!n_recs) {
    fprintf(f, "%s: no kernel records\n", title);
    return -1;
  }
  qsort(recs, n_recs, sizeof *recs, by_start);
  agg *a = calloc(n_recs, sizeof *a);
  size_t na = 0;
  uint64_t t0 = recs[0].start, last = recs[0].start;
  /* every device: their kernels interleaved on the one clock, the device named, each kernel's
   * critical-path share against its own device's latest end */
  enum { KT_DEVS = 16 };
  uint64_t dev_last[KT_DEVS];
  for (int d = 0; d < KT_DEVS; d++) dev_last[d] = t0;
  fprintf(f, "%s: %zu kernels\n", title, n_recs);
  fprintf(f, "%5s %-44s %7s %5s %9s %9s %9s%s\n", "#", "kernel", "grid", "block", "start us", "dur us", "crit us",
          device < 0 ? "  gpu" : "");
  for (size_t i = 0; i < n_recs; i++) {
    const krec *e = &recs[i];
    uint64_t *dl = &dev_last[e->device % KT_DEVS];
    double crit = e->end > *dl ? (double)(e->end - *dl) * 1e-3 : 0.0;
    if (e->end > *dl) *dl = e->end;
    if (e->end > last) last = e->end;
    fprintf(f, "%5zu %-44.44s %7d %5d %9.2f %9.2f %9.2f", i, e->name, e->grid, e->block,
            (double)(e->start - t0) * 1e-3, (double)(e->end - e->start) * 1e-3, crit);
    if (device < 0) fprintf(f, " %4u", e->device);
    fputc('\n', f);
    size_t j = 0;
    while (j < na && strcmp(a[j].name, e->name)) j++;
    if (j == na) snprintf(a[na++].name, sizeof a[0].name, "%s", e->name);
    a[j].n++;
    a[j].crit += crit;
    a[j].dur += (double)(e->end - e->start) * 1e-3;
  }
  qsort(a, na, sizeof *a, by_crit);
  fprintf(f, "%s: %.1f us from the first start to the last end; by kernel (critical-path share):\n", title,
          (double)(last - t0) * 1e-3);
  fprintf(f, "%-44s %6s %10s %10s %10s\n", "kernel", "count", "crit us", "crit/each", "dur/each");
  for (size_t j = 0; j < na; j++)
    fprintf(f, "%-44.44s %6d %10.1f %10.2f %10.2f\n", a[j].name, a[j].n, a[j].crit, a[j].crit / a[j].n,
            a[j].dur / a[j].n);
  free(a);
  n_recs = 0;
  return 0;
}

#else

bool td_ktrace_available(void) { return false; }
int td_ktrace_begin(void) { return -1; }
int td_ktrace_discard(void) { return -1; }
int td_ktrace_end(FILE *f, const char *title) {
  fprintf(f, "%s: this build has no CUPTI\n", title);
  return -1;
}
int td_ktrace_end_device(FILE *f, const char *title, int device) {
  (void)device;
  return td_ktrace_end(f, title);
}

#endif
