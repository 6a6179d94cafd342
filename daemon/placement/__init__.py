"""Planning before anything starts: topology discovery (topology), CPU lists (cpulist), which
CPUs and memory node each rank gets (binding) and how much memory each rank needs (memory_plan).
Pure functions over data read from sysfs/procfs: no processes, no sockets."""
