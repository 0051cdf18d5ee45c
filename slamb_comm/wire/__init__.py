"""What travels: the fused layout of a list of tensors, the masks that pick M_t, the codecs (top-k, chunk
top-k) and the byte statistics. Above the device kernels, below the exchanges.
"""
