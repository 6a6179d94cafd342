"""Planning before anything starts: topology discovery (topology), CPU lists (cpulist), which
CPUs and memory node each rank gets (binding), how much memory each rank needs (memory_plan),
and the one entry that runs them in order for a start (start). Pure functions over data read
from sysfs/procfs: no processes, no sockets."""
