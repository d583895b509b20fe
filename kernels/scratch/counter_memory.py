"""Why a chain's first tickets come 6-12 us late (runs 46-49): is it where the counters live? kernels.sync_counters()
makes them from host data, which MLX's CUDA allocator places in managed memory (cudaMallocManaged: malloc without a
stream); a GPU op's output is device memory (cudaMallocAsync). Each block's thread 0 takes a ticket with atomicAdd on
the counters, as lily_sync_ticket does, and records by %globaltimer how long it took; 20 launches a variant, each
in its own eval, and the same counters reused as a compiled step's constant is.
    python3 kernels/scratch/counter_memory.py [--blocks 512]
"""

import argparse

import mlx.core as mx
import numpy as np

SOURCE = """
  unsigned long long t0, t1;
  if (threadIdx.x == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    int v = atomicAdd(const_cast<int*>(sync), 1);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    took[blockIdx.x] = static_cast<int>(t1 - t0) + (v < 0);
  }
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--launches", type=int, default=20)
    a = ap.parse_args()
    kernel = mx.fast.cuda_kernel(name="ticket_probe", input_names=["sync"], output_names=["took"], source=SOURCE)
    variants = {
        "host data (mx.array from numpy: managed memory)": lambda: mx.array(np.zeros(16, np.int32)),
        "GPU op output (mx.zeros, evaluated: device memory)": lambda: mx.zeros((16,), mx.int32),
    }
    for name, make in variants.items():
        for reuse in (False, True):
            sync = make()
            mx.eval(sync)
            firsts, medians = [], []
            for i in range(a.launches):
                if not reuse:
                    sync = make()
                    mx.eval(sync)
                (took,) = kernel(inputs=[sync], grid=(a.blocks * 128, 1, 1), threadgroup=(128, 1, 1),
                                 output_shapes=[(a.blocks,)], output_dtypes=[mx.int32])
                t = np.array(took) / 1e3
                if i:
                    firsts.append(np.sort(t)[: a.blocks // 8].mean())
                    medians.append(np.median(t))
            print(f"{name}, {'one array reused' if reuse else 'a fresh array a launch'}: a block's ticket "
                  f"median {np.median(medians):.2f} us, fastest eighth {np.median(firsts):.2f} us, "
                  f"max {t.max():.2f} us ({a.blocks} blocks)")


if __name__ == "__main__":
    main()
