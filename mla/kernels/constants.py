"""Numbers the kernel launchers share."""

# log2(e): the kernels compute exp(x) as exp2(x * log2(e)); launchers fold it into the scale.
LOG2E = 1.4426950408889634

# CUDA's limit on a grid's y and z dimensions, over which the launchers spread heads, sequences,
# query rows and KV splits.
MAX_GRID_YZ = 65535
