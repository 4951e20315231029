"""Our CUDA dispatch/combine kernels (optional; reports "not built" on machines without CUDA)."""
