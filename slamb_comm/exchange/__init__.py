"""How it travels: transports (MPI, NCCL, a single process) and the Communicator, which owns its
exchanges (masked allreduce, top-k allgather, 1-bit, dense sync). Above the wire, below the methods.
"""
