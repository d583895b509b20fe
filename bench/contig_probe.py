# Which MLX CUDA op mis-reads strided views? gather_mm with sliced experts, or conv1d with moved-axis weights.
import mlx.core as mx, numpy as np
E,I2,H = 5, 64, 64
gu = mx.random.normal((E, I2, H)); w = gu[..., :I2//2, :]
x = mx.random.normal((3, 1, 1, H)); idx = mx.array([[0,2],[1,4],[3,3]])
a = mx.gather_mm(x, w.swapaxes(-1,-2), rhs_indices=idx); b = mx.gather_mm(x, mx.contiguous(w).swapaxes(-1,-2), rhs_indices=idx)
print("gather_mm strided vs contiguous:", float(mx.abs(a-b).max()))
cw = mx.random.normal((12, 1, 4)); xs = mx.random.normal((2, 9, 12))
a = mx.conv1d(xs, cw.moveaxis(2,1), groups=12); b = mx.conv1d(xs, mx.contiguous(cw.moveaxis(2,1)), groups=12)
print("conv1d strided vs contiguous:", float(mx.abs(a-b).max()))
