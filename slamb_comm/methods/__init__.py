"""The optimizers' rules on flat arrays: SLAMB (and SAdamW), 1-bit LAMB, DiLoCo/DES-LOC, DeMo, SparseLoCo,
and their checkpoints. Each is built from an exchange and its hyper-parameters.
"""
