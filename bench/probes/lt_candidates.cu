/* cuBLASLt's candidates for the encoder and decode GEMM shapes (Whisper-large-v3's encoder at a TP=2 rank's 750
 * rows, TP=1's 1,500 and 16 inputs' 24,000; Flan-T5-XL's 64-row decode GEMMs at TP=1 and a rank of 2): the
 * heuristic's first choice, which td_gemm takes, against the fastest of up to N (argv[1], default 32; cuBLASLt
 * returns at most 8 for these). Each shape runs alone in a loop, so the small decode GEMMs' weights stay in L2.
 * A one-off probe, not built by CMake:
 *   nvcc -arch=sm_90a -O2 -o lt_candidates bench/probes/lt_candidates.cu -lcublasLt
 * Results: bench/RESULTS.md, "A sequence's state groups sharing their tiles" (2026-11-29). */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { if ((x) != 0) { printf("fail %s:%d\n", __FILE__, __LINE__); exit(1); } } while (0)
int main(int argc, char **argv) {
  int NC = argc > 1 ? atoi(argv[1]) : 32;
  cublasLtHandle_t lt; CK(cublasLtCreate(&lt));
  size_t wsb = 32u << 20; void *ws; CK(cudaMalloc(&ws, wsb));
  void *X, *W, *Y, *B; CK(cudaMalloc(&X, 256u << 20)); CK(cudaMalloc(&W, 64u << 20)); CK(cudaMalloc(&Y, 256u << 20)); CK(cudaMalloc(&B, 1 << 20));
  CK(cudaMemset(X, 0x3c, 256u << 20)); CK(cudaMemset(W, 0x3c, 64u << 20)); CK(cudaMemset(Y, 0, 256u << 20)); CK(cudaMemset(B, 0, 1 << 20));
  cudaStream_t s; CK(cudaStreamCreate(&s)); cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  struct sh { const char *name; int m, n, k, accum; } shapes[] = {
    {"enc qkv", 750, 3840, 1280, 0}, {"enc o", 750, 1280, 1280, 1}, {"enc ffn in", 750, 5120, 1280, 0}, {"enc ffn out", 750, 1280, 5120, 1}, {"enc ckv x8", 750, 20480, 1280, 0},
    {"enc qkv", 1500, 3840, 1280, 0}, {"enc o", 1500, 1280, 1280, 1}, {"enc ffn in", 1500, 5120, 1280, 0}, {"enc ffn out", 1500, 1280, 5120, 1}, {"enc ckv x8", 1500, 20480, 1280, 0},
    {"enc qkv", 24000, 3840, 1280, 0}, {"enc o", 24000, 1280, 1280, 1}, {"enc ffn in", 24000, 5120, 1280, 0}, {"enc ffn out", 24000, 1280, 5120, 1},
    {"dec qkv r2", 64, 3072, 2048, 0}, {"dec o r2", 64, 2048, 1024, 1}, {"dec q r2", 64, 1024, 2048, 0}, {"dec ffn in r2", 64, 5120, 2048, 0}, {"dec ffn out r2", 64, 2048, 2560, 1},
    {"dec qkv", 64, 6144, 2048, 0}, {"dec o", 64, 2048, 2048, 1}, {"dec q", 64, 2048, 2048, 0}, {"dec ffn in", 64, 10240, 2048, 0}, {"dec ffn out", 64, 2048, 5120, 1},
  };
  for (auto &S : shapes) {
    cublasLtMatmulDesc_t op; CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS; CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    int32_t bt = CUDA_R_16BF; CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &B, sizeof B));
    cublasLtMatrixLayout_t la, lb, lc;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, S.k, S.n, S.k)); CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, S.k, S.m, S.k));
    CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, S.n, S.m, S.n));
    cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    std::vector<cublasLtMatmulHeuristicResult_t> res(NC); int found = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, NC, res.data(), &found));
    float alpha = 1, beta = S.accum ? 1.f : 0.f; float first = 0, best = 1e9; int bi = -1;
    for (int i = 0; i < found; i++) {
      int reps = S.m >= 24000 ? 5 : 20; bool ok = true;
      for (int r = 0; r < 3; r++) ok &= cublasLtMatmul(lt, op, &alpha, W, la, X, lb, &beta, Y, lc, Y, lc, &res[i].algo, ws, wsb, s) == 0;
      cudaEventRecord(e0, s);
      for (int r = 0; r < reps; r++) ok &= cublasLtMatmul(lt, op, &alpha, W, la, X, lb, &beta, Y, lc, Y, lc, &res[i].algo, ws, wsb, s) == 0;
      cudaEventRecord(e1, s); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1);
      if (!ok) { cudaGetLastError(); continue; }
      float us = ms * 1000 / reps; if (i == 0) first = us; if (us < best) best = us, bi = i;
    }
    double fl = 2.0 * S.m * S.n * S.k;
    printf("%-15s m=%5d n=%5d k=%5d%s: first %7.1f us (%4.0f TF/s), best #%d of %d %7.1f us (%4.0f TF/s) = %.2fx\n", S.name, S.m, S.n, S.k,
           S.accum ? " acc" : "    ", first, fl / first / 1e6, bi, found, best, fl / best / 1e6, best / first);
    cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(lc); cublasLtMatmulDescDestroy(op);
  }
  return 0;
}
