"""The device kernels (CUDA C in one dialect that the host's C++ compiler also takes) and their launchers:
SLAMB's step, top-k and 1-bit LAMB on tables of tiles and addresses. Imports nothing above it.
"""
