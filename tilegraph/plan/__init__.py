"""Client side: passes that place the logical graph's kernels on device classes and cluster them
into tasks for worker processes. Nothing here imports dask."""
