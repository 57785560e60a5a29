/* Hugging Face checkpoints in safetensors format: one file, or shards named
 * by model.safetensors.index.json. Files are mmap'ed and validated on open
 * (header size cap, well-formed JSON, known dtypes, shape x dtype = byte
 * range, ranges inside the file and not overlapping). */
#ifndef TD_MODEL_SAFETENSORS_H
#define TD_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TD_MAX_DIMS 8
#define TD_SAFETENSORS_MAX_HEADER (100u << 20)

typedef enum td_dtype {
  TD_DT_F32, TD_DT_F16, TD_DT_BF16, TD_DT_F64, TD_DT_I64, TD_DT_I32, TD_DT_I16, TD_DT_I8,
  TD_DT_U64, TD_DT_U32, TD_DT_U16, TD_DT_U8, TD_DT_BOOL, TD_DT_F8_E4M3, TD_DT_F8_E5M2,
  TD_DT_COUNT
} td_dtype;

const char *td_dtype_name(td_dtype dt);
size_t td_dtype_size(td_dtype dt);

typedef struct td_tensor_info {
  const char *name;
  td_dtype dtype;
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t numel;
  const void *data; /* inside the mmap'ed file */
  size_t nbytes;
  const char *path; /* file holding it */
} td_tensor_info;

typedef struct td_checkpoint td_checkpoint;

/* path: a model folder (model.safetensors.index.json or model.safetensors),
 * or one .safetensors file. */
td_status td_checkpoint_open(const char *path, td_checkpoint **out);
void td_checkpoint_close(td_checkpoint *ck);

size_t td_checkpoint_count(const td_checkpoint *ck);
/* NULL when absent. */
const td_tensor_info *td_checkpoint_find(const td_checkpoint *ck, const char *name);
/* The i-th tensor in name order (0 <= i < count). */
const td_tensor_info *td_checkpoint_at(const td_checkpoint *ck, size_t i);

/* Converts a tensor of any float dtype to float32 after checking its shape
 * (ndim dims in shape; a -1 entry matches any size). dst holds numel floats. */
td_status td_tensor_read_f32(const td_tensor_info *t, int ndim, const int64_t *shape, float *dst);

#endif
