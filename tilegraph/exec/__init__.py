"""Worker side: the programs that fused tasks run, and the runner that spreads a task's kernel
calls over its worker's threads. Nothing here builds graphs or talks to the scheduler."""
