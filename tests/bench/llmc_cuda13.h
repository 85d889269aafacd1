/* tests/bench/llmc_cuda13.h - force-included (nvcc -include) when
 * tests/bench/gpu.sh builds llm.c's CUDA trainers with CUDA 13: its
 * runtime takes a cudaMemLocation where CUDA 12's cudaMemAdvise took a
 * device number, which llm.c at f1e2ace passes (in its managed-memory
 * fallback, llmc/cuda_utils.cuh).  Nothing else of llm.c is changed. */
#include <cuda_runtime.h>
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
static inline cudaError_t llmc_mem_advise_device(const void *p, size_t n, enum cudaMemoryAdvise a,
                                                 int device)
{
    cudaMemLocation loc;
    loc.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    loc.id = device == cudaCpuDeviceId ? 0 : device;
    return cudaMemAdvise(p, n, a, loc);
}
#define cudaMemAdvise llmc_mem_advise_device
#endif
