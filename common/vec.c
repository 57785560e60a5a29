/* Growable arrays (common/vec.h): capacity doubles from a small start. */
#include "common/vec.h"

#include <stdlib.h>
#include <string.h>

/* Grows *v to hold at least want elements of size sz (doubling from first). */
static td_status grow(void **v, int *cap, int want, size_t sz, int first) {
  if (want <= *cap) return TD_OK;
  if (want < 0) return td_err(TD_ERR_INVALID, "array of %d elements", want);
  int nc = *cap ? *cap : first;
  while (nc < want) nc = nc > INT32_MAX / 2 ? want : 2 * nc;
  void *p = realloc(*v, sz * (size_t)nc);
  if (!p) return td_err(TD_ERR_NOMEM, "out of memory");
  *v = p;
  *cap = nc;
  return TD_OK;
}

td_status td_i32vec_reserve(td_i32vec *a, int cap) { return grow((void **)&a->v, &a->cap, cap, sizeof *a->v, 8); }

td_status td_i32vec_push(td_i32vec *a, int32_t x) {
  TD_TRY(td_i32vec_reserve(a, a->n + 1));
  a->v[a->n++] = x;
  return TD_OK;
}

td_status td_i32vec_assign(td_i32vec *a, const int32_t *src, int n) {
  TD_TRY(td_i32vec_reserve(a, n));
  if (n) memcpy(a->v, src, sizeof *src * (size_t)n);
  a->n = n;
  return TD_OK;
}

void td_i32vec_free(td_i32vec *a) {
  free(a->v);
  *a = (td_i32vec){0};
}

td_status td_f32vec_reserve(td_f32vec *a, int cap) { return grow((void **)&a->v, &a->cap, cap, sizeof *a->v, 8); }

td_status td_f32vec_push(td_f32vec *a, float x) {
  TD_TRY(td_f32vec_reserve(a, a->n + 1));
  a->v[a->n++] = x;
  return TD_OK;
}

td_status td_f32vec_append(td_f32vec *a, const float *src, int n) {
  if (n > INT32_MAX - a->n) return td_err(TD_ERR_INVALID, "array of more than %d elements", INT32_MAX);
  TD_TRY(td_f32vec_reserve(a, a->n + n));
  if (n) memcpy(a->v + a->n, src, sizeof *src * (size_t)n);
  a->n += n;
  return TD_OK;
}

void td_f32vec_free(td_f32vec *a) {
  free(a->v);
  *a = (td_f32vec){0};
}

td_status td_ptrvec_insert(td_ptrvec *a, int at, void *x) {
  TD_TRY(grow((void **)&a->v, &a->cap, a->n + 1, sizeof *a->v, 16));
  memmove(a->v + at + 1, a->v + at, sizeof *a->v * (size_t)(a->n - at));
  a->v[at] = x;
  a->n++;
  return TD_OK;
}

bool td_ptrvec_remove(td_ptrvec *a, const void *x) {
  for (int i = 0; i < a->n; i++)
    if (a->v[i] == x) {
      memmove(a->v + i, a->v + i + 1, sizeof *a->v * (size_t)(a->n - i - 1));
      a->n--;
      return true;
    }
  return false;
}

void td_ptrvec_free(td_ptrvec *a) {
  free(a->v);
  *a = (td_ptrvec){0};
}
