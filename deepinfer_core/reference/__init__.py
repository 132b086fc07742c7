"""The built-in `cpu` backend: the reference `KernelOps`, gloo collectives, host memory."""
