/* Growable arrays: int32 and float values, and pointers kept in order.
 * Fields are public (v[0, n) is the content); the functions grow the
 * storage and answer TD_ERR_NOMEM when it cannot. A zeroed struct is an
 * empty array; *_free releases the storage and empties it. */
#ifndef TD_COMMON_VEC_H
#define TD_COMMON_VEC_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

typedef struct td_i32vec {
  int32_t *v;
  int n, cap;
} td_i32vec;

/* Room for at least cap values (n unchanged). */
td_status td_i32vec_reserve(td_i32vec *a, int cap);
td_status td_i32vec_push(td_i32vec *a, int32_t x);
/* The content becomes src[0, n). */
td_status td_i32vec_assign(td_i32vec *a, const int32_t *src, int n);
void td_i32vec_free(td_i32vec *a);

typedef struct td_f32vec {
  float *v;
  int n, cap;
} td_f32vec;

td_status td_f32vec_reserve(td_f32vec *a, int cap);
td_status td_f32vec_push(td_f32vec *a, float x);
/* Appends src[0, n). */
td_status td_f32vec_append(td_f32vec *a, const float *src, int n);
void td_f32vec_free(td_f32vec *a);

/* Pointers in order (queues that insert at either end and remove from
 * anywhere). */
typedef struct td_ptrvec {
  void **v;
  int n, cap;
} td_ptrvec;

/* Inserts x before position at (0 <= at <= n). */
td_status td_ptrvec_insert(td_ptrvec *a, int at, void *x);
/* Removes the first x, keeping the others' order; false when absent. */
bool td_ptrvec_remove(td_ptrvec *a, const void *x);
void td_ptrvec_free(td_ptrvec *a);

#endif
