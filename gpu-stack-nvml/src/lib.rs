//! gpu-stack-nvml: the GPU side effects of gpu-stack.
