"""The staged worker pool (`direct=False`, `workers` >= 2): threads in the paper's roles (mode
"ubep") or the baseline's barrier-separated phases (mode "bsp"). `path.py` is `PoolPath`; its
kernels are the shared ones in `runtime/shm/kernels/`; the pool has no compiled entry (its
calls span threads)."""
