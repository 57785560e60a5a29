#include "model/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <uthash.h>

#include "common/half.h"
#include "common/json.h"

typedef struct st_file {
  char *path;
  void *map;
  size_t size;
} st_file;

typedef struct st_entry {
  td_tensor_info info;
  char *name;
  UT_hash_handle hh;
} st_entry;

struct td_checkpoint {
  st_file *files;
  int n_files;
  st_entry *table;   /* uthash by name */
  st_entry **sorted; /* name order */
  size_t count;
};

static const struct {
  const char *name;
  size_t size;
} dtypes[TD_DT_COUNT] = {
    [TD_DT_F32] = {"F32", 4},  [TD_DT_F16] = {"F16", 2},     [TD_DT_BF16] = {"BF16", 2},
    [TD_DT_F64] = {"F64", 8},  [TD_DT_I64] = {"I64", 8},     [TD_DT_I32] = {"I32", 4},
    [TD_DT_I16] = {"I16", 2},  [TD_DT_I8] = {"I8", 1},       [TD_DT_U64] = {"U64", 8},
    [TD_DT_U32] = {"U32", 4},  [TD_DT_U16] = {"U16", 2},     [TD_DT_U8] = {"U8", 1},
    [TD_DT_BOOL] = {"BOOL", 1}, [TD_DT_F8_E4M3] = {"F8_E4M3", 1}, [TD_DT_F8_E5M2] = {"F8_E5M2", 1},
};

const char *td_dtype_name(td_dtype dt) { return (unsigned)dt < TD_DT_COUNT ? dtypes[dt].name : "?"; }
size_t td_dtype_size(td_dtype dt) { return (unsigned)dt < TD_DT_COUNT ? dtypes[dt].size : 0; }

static int parse_dtype(const char *s) {
  for (int i = 0; i < TD_DT_COUNT; i++)
    if (strcmp(s, dtypes[i].name) == 0) return i;
  return -1;
}

static int cmp_offset(const void *a, const void *b) {
  const st_entry *x = *(st_entry *const *)a, *y = *(st_entry *const *)b;
  const uint8_t *px = x->info.data, *py = y->info.data;
  return px < py ? -1 : px > py;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp((*(st_entry *const *)a)->name, (*(st_entry *const *)b)->name);
}

static void free_entry(st_entry *e) {
  if (!e) return;
  free(e->name);
  free(e);
}

/* Parses one header entry into a new table entry. */
static td_status parse_entry(const char *path, const cJSON *item, const uint8_t *data, size_t data_size,
                             st_entry **out) {
  const char *name = item->string;
  if (!cJSON_IsObject(item))
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": header entry is not an object", path, name);
  const cJSON *jd = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  const cJSON *js = cJSON_GetObjectItemCaseSensitive(item, "shape");
  const cJSON *jo = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
  if (!cJSON_IsString(jd) || !cJSON_IsArray(js) || !cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2)
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": expected \"dtype\", \"shape\" and two \"data_offsets\"",
                  path, name);
  int dt = parse_dtype(jd->valuestring);
  if (dt < 0) return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": unknown dtype \"%s\"", path, name, jd->valuestring);
  int ndim = cJSON_GetArraySize(js);
  if (ndim > TD_MAX_DIMS)
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": %d dimensions, at most %d supported", path, name, ndim,
                  TD_MAX_DIMS);
  st_entry *e = calloc(1, sizeof *e);
  if (!e) return td_err(TD_ERR_NOMEM, "%s: out of memory", path);
  e->name = strdup(name);
  if (!e->name) {
    free(e);
    return td_err(TD_ERR_NOMEM, "%s: out of memory", path);
  }
  td_tensor_info *t = &e->info;
  t->name = e->name;
  t->dtype = (td_dtype)dt;
  t->ndim = ndim;
  t->path = path;
  uint64_t numel = 1;
  const uint64_t cap = (uint64_t)1 << 50;
  for (int i = 0; i < ndim; i++) {
    const cJSON *d = cJSON_GetArrayItem(js, i);
    if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble != floor(d->valuedouble) ||
        d->valuedouble > (double)cap) {
      free_entry(e);
      return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": shape[%d] is not a valid size", path, name, i);
    }
    t->shape[i] = (int64_t)d->valuedouble;
    numel *= (uint64_t)t->shape[i];
    if (numel > cap) {
      free_entry(e);
      return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": shape is too large", path, name);
    }
  }
  t->numel = (int64_t)numel;
  double b = cJSON_GetArrayItem(jo, 0)->valuedouble, en = cJSON_GetArrayItem(jo, 1)->valuedouble;
  if (!cJSON_IsNumber(cJSON_GetArrayItem(jo, 0)) || !cJSON_IsNumber(cJSON_GetArrayItem(jo, 1)) || b < 0 ||
      en < b || b != floor(b) || en != floor(en)) {
    free_entry(e);
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": bad data_offsets", path, name);
  }
  if (en > (double)data_size) {
    free_entry(e);
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%.0f, %.0f] reach past the end of the data (%zu bytes); the file is truncated or corrupt",
                  path, name, b, en, data_size);
  }
  size_t nbytes = (size_t)(en - b);
  if ((uint64_t)nbytes != numel * dtypes[dt].size) {
    free_entry(e);
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\": %zu bytes for %llu elements of %s (expected %llu)", path,
                  name, nbytes, (unsigned long long)numel, dtypes[dt].name,
                  (unsigned long long)(numel * dtypes[dt].size));
  }
  t->data = data + (size_t)b;
  t->nbytes = nbytes;
  *out = e;
  return TD_OK;
}

/* Maps one file and adds its tensors to ck. */
static td_status add_file(td_checkpoint *ck, const char *path) {
  st_file *f = &ck->files[ck->n_files];
  f->path = strdup(path);
  if (!f->path) return td_err(TD_ERR_NOMEM, "out of memory");
  ck->n_files++;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return td_err(errno == ENOENT ? TD_ERR_NOT_FOUND : TD_ERR_IO, "%s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return td_err(TD_ERR_IO, "%s: %s", path, strerror(errno));
  }
  f->size = (size_t)st.st_size;
  if (f->size < 8) {
    close(fd);
    return td_err(TD_ERR_FORMAT, "%s: %zu bytes, too short for a safetensors file (truncated?)", path, f->size);
  }
  f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (f->map == MAP_FAILED) {
    f->map = NULL;
    return td_err(TD_ERR_IO, "%s: mmap: %s", path, strerror(errno));
  }
  const uint8_t *base = f->map;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | base[i];
  if (hlen > TD_SAFETENSORS_MAX_HEADER)
    return td_err(TD_ERR_FORMAT, "%s: header of %llu bytes exceeds the %u-byte limit", path,
                  (unsigned long long)hlen, TD_SAFETENSORS_MAX_HEADER);
  if (hlen > f->size - 8)
    return td_err(TD_ERR_FORMAT, "%s: header of %llu bytes is longer than the file (%zu bytes; truncated?)", path,
                  (unsigned long long)hlen, f->size);
  cJSON *hdr = NULL;
  char src[PATH_MAX + 16];
  snprintf(src, sizeof src, "%s header", path);
  TD_TRY(td_json_parse((const char *)base + 8, (size_t)hlen, src, &hdr));
  td_status s = TD_OK;
  if (!cJSON_IsObject(hdr)) {
    s = td_err(TD_ERR_FORMAT, "%s: header is not a JSON object", path);
    goto out;
  }
  const uint8_t *data = base + 8 + hlen;
  size_t data_size = f->size - 8 - (size_t)hlen;
  int n = cJSON_GetArraySize(hdr);
  st_entry **mine = calloc((size_t)n + 1, sizeof *mine);
  if (!mine) {
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto out;
  }
  int m = 0;
  const cJSON *item;
  cJSON_ArrayForEach(item, hdr) {
    if (strcmp(item->string, "__metadata__") == 0) continue;
    st_entry *e = NULL, *dup = NULL;
    s = parse_entry(path, item, data, data_size, &e);
    if (s != TD_OK) goto out_mine;
    HASH_FIND_STR(ck->table, e->name, dup);
    if (dup) {
      s = td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" appears twice (also in %s)", path, e->name, dup->info.path);
      free_entry(e);
      goto out_mine;
    }
    e->info.path = f->path;
    HASH_ADD_KEYPTR(hh, ck->table, e->name, strlen(e->name), e);
    mine[m++] = e;
  }
  qsort(mine, (size_t)m, sizeof *mine, cmp_offset);
  const uint8_t *prev_end = data;
  const char *prev = NULL;
  for (int i = 0; i < m; i++) {
    const td_tensor_info *t = &mine[i]->info;
    if (t->nbytes == 0) continue;
    if ((const uint8_t *)t->data < prev_end) {
      s = td_err(TD_ERR_FORMAT, "%s: tensors \"%s\" and \"%s\" overlap", path, prev, t->name);
      goto out_mine;
    }
    prev_end = (const uint8_t *)t->data + t->nbytes;
    prev = t->name;
  }
out_mine:
  free(mine);
out:
  cJSON_Delete(hdr);
  return s;
}

static bool is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static td_status open_sharded(td_checkpoint *ck, const char *dir, const char *index) {
  cJSON *j = NULL;
  TD_TRY(td_json_load_file(index, 64u << 20, &j));
  td_status s = TD_OK;
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
  if (!cJSON_IsObject(map)) {
    s = td_err(TD_ERR_FORMAT, "%s: missing object \"weight_map\"", index);
    goto out;
  }
  /* Distinct shard names, in order of first use. */
  int n = cJSON_GetArraySize(map);
  const char **names = calloc((size_t)n + 1, sizeof *names);
  ck->files = calloc((size_t)n + 1, sizeof *ck->files);
  if (!names || !ck->files) {
    free(names);
    s = td_err(TD_ERR_NOMEM, "out of memory");
    goto out;
  }
  int k = 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, map) {
    if (!cJSON_IsString(it) || strchr(it->valuestring, '/')) {
      s = td_err(TD_ERR_FORMAT, "%s: weight_map[\"%s\"] must name a file in the same folder", index, it->string);
      goto out_names;
    }
    int seen = 0;
    for (int i = 0; i < k && !seen; i++) seen = strcmp(names[i], it->valuestring) == 0;
    if (!seen) names[k++] = it->valuestring;
  }
  for (int i = 0; i < k; i++) {
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", dir, names[i]);
    s = add_file(ck, p);
    if (s != TD_OK) goto out_names;
  }
  cJSON_ArrayForEach(it, map) {
    st_entry *e = NULL;
    HASH_FIND_STR(ck->table, it->string, e);
    if (!e) {
      s = td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" is listed in weight_map but not in %s", index, it->string,
                 it->valuestring);
      goto out_names;
    }
    const char *base = strrchr(e->info.path, '/');
    if (strcmp(base ? base + 1 : e->info.path, it->valuestring) != 0) {
      s = td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" is in %s, not %s", index, it->string, e->info.path,
                 it->valuestring);
      goto out_names;
    }
  }
out_names:
  free(names);
out:
  cJSON_Delete(j);
  return s;
}

td_status td_checkpoint_open(const char *path, td_checkpoint **out) {
  *out = NULL;
  td_checkpoint *ck = calloc(1, sizeof *ck);
  if (!ck) return td_err(TD_ERR_NOMEM, "out of memory");
  td_status s;
  if (is_dir(path)) {
    char index[PATH_MAX], single[PATH_MAX];
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", path);
    snprintf(single, sizeof single, "%s/model.safetensors", path);
    if (access(index, F_OK) == 0) {
      s = open_sharded(ck, path, index);
    } else if (access(single, F_OK) == 0) {
      ck->files = calloc(1, sizeof *ck->files);
      s = ck->files ? add_file(ck, single) : td_err(TD_ERR_NOMEM, "out of memory");
    } else {
      s = td_err(TD_ERR_NOT_FOUND, "%s: no model.safetensors or model.safetensors.index.json", path);
    }
  } else {
    ck->files = calloc(1, sizeof *ck->files);
    s = ck->files ? add_file(ck, path) : td_err(TD_ERR_NOMEM, "out of memory");
  }
  if (s == TD_OK) {
    ck->count = HASH_COUNT(ck->table);
    ck->sorted = calloc(ck->count + 1, sizeof *ck->sorted);
    if (!ck->sorted) {
      s = td_err(TD_ERR_NOMEM, "out of memory");
    } else {
      size_t i = 0;
      for (st_entry *e = ck->table; e; e = e->hh.next) ck->sorted[i++] = e;
      qsort(ck->sorted, ck->count, sizeof *ck->sorted, cmp_name);
    }
  }
  if (s != TD_OK) {
    td_checkpoint_close(ck);
    return s;
  }
  *out = ck;
  return TD_OK;
}

void td_checkpoint_close(td_checkpoint *ck) {
  if (!ck) return;
  st_entry *e, *tmp;
  HASH_ITER(hh, ck->table, e, tmp) {
    HASH_DEL(ck->table, e);
    free_entry(e);
  }
  free(ck->sorted);
  for (int i = 0; i < ck->n_files; i++) {
    if (ck->files[i].map) munmap(ck->files[i].map, ck->files[i].size);
    free(ck->files[i].path);
  }
  free(ck->files);
  free(ck);
}

size_t td_checkpoint_count(const td_checkpoint *ck) { return ck->count; }

const td_tensor_info *td_checkpoint_find(const td_checkpoint *ck, const char *name) {
  st_entry *e = NULL;
  HASH_FIND_STR(ck->table, name, e);
  return e ? &e->info : NULL;
}

const td_tensor_info *td_checkpoint_at(const td_checkpoint *ck, size_t i) {
  return i < ck->count ? &ck->sorted[i]->info : NULL;
}

td_status td_tensor_read_f32(const td_tensor_info *t, int ndim, const int64_t *shape, float *dst) {
  bool ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || shape[i] == t->shape[i];
  if (!ok) {
    char want[128] = "", have[128] = "";
    size_t wl = 0, hl = 0;
    for (int i = 0; i < ndim && wl < sizeof want; i++)
      wl += (size_t)snprintf(want + wl, sizeof want - wl, "%s%lld", i ? ", " : "", (long long)shape[i]);
    for (int i = 0; i < t->ndim && hl < sizeof have; i++)
      hl += (size_t)snprintf(have + hl, sizeof have - hl, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    return td_err(TD_ERR_FORMAT, "%s: tensor \"%s\" has shape [%s], expected [%s]", t->path, t->name, have, want);
  }
  const uint8_t *p = t->data;
  size_t n = (size_t)t->numel;
  switch (t->dtype) {
    case TD_DT_F32:
      memcpy(dst, p, n * 4);
      break;
    case TD_DT_F16:
      for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        dst[i] = td_f16_to_f32(h);
      }
      break;
    case TD_DT_BF16:
      for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        dst[i] = td_bf16_to_f32(h);
      }
      break;
    case TD_DT_F64:
      for (size_t i = 0; i < n; i++) {
        double d;
        memcpy(&d, p + 8 * i, 8);
        dst[i] = (float)d;
      }
      break;
    default:
      return td_err(TD_ERR_UNSUPPORTED, "%s: tensor \"%s\" has dtype %s; expected F32, F16, BF16 or F64", t->path,
                    t->name, td_dtype_name(t->dtype));
  }
  return TD_OK;
}
