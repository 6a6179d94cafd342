"""Facts about a model read from its files: config, sizes, tensor names, quantization, the CPU.

Torch-free: the supervisor, the frontend and doctor read these; the ranks build on them.
"""
