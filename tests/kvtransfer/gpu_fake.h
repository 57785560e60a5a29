/* Test hooks of the fake GPU (gpu_fake.c), beyond kvtransfer/gpu.h. */
#ifndef TD_TESTS_KVX_GPU_FAKE_H
#define TD_TESTS_KVX_GPU_FAKE_H

#include <stdbool.h>
#include <stddef.h>

/* "Device memory" that CUDA IPC may export: zeroed, shared (memfd), so
 * that another process maps it from the handle as cudaIpcOpenMemHandle
 * would. Memory from malloc exports no handle. */
void *kvx_fake_dev_alloc(size_t bytes);
void kvx_fake_dev_free(void *p);
/* kvx_gpu_ipc_open fails from now on (another container, no peer access). */
void kvx_fake_ipc_refuse(bool refuse);
/* Peer allocations mapped in this process now. */
int kvx_fake_ipc_mapped(void);
/* Mappings closed while a copy into them was still pending. */
int kvx_fake_ipc_violations(void);
/* kvx_gpu_record fails on this stream from now on (-1: on none). */
void kvx_fake_fail_record(int stream);

#endif
