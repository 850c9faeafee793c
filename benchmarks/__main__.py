import os

# The driver starts the mesh's processes (fork, then exec) while gRPC's threads run: gRPC's
# fork handlers have nothing to do for that, and would log a line for every process started.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from benchmarks.harness import run  # after the variable, which gRPC reads at import

run()
