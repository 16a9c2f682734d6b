"""fedpipe: federated split-learning pipelines for LLMs on edge devices."""

import os
import sys

# gRPC's fork handlers off, before anything imports grpc. Ray forks (subprocess.Popen with a
# preexec_fn: a real fork with Python in the child) from the process that starts it: Flower's
# simulation starts it in the ServerApp's process, a StageServer with replicas in its own.
# With gRPC's default (the variable unset: its C core's fork handlers on, skipped when other
# threads are inside gRPC), a fork while a stream is live breaks gRPC in the parent: streams
# stall, a message arrives twice, HTTP/2 frames fail to parse, the process can crash
# (benchmarks/stress_bench.py --forks; docs/benchmarks/stress.md). With it off, nothing runs
# at fork, which is right for children that exec at once. A value set by the user stays.
# Where grpc was imported first (a process Flower starts), the setting came too late for this
# process: fedpipe's launcher sets it in every process it starts (fedpipe.launch.processes).
GRPC_FORK_SETTING_LATE = "grpc" in sys.modules and "GRPC_ENABLE_FORK_SUPPORT" not in os.environ
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__version__ = "0.1.0"
__all__ = ["GRPC_FORK_SETTING_LATE", "__version__"]
