"""dask-mpi launch: rank 0 runs the scheduler, rank 1 the client script, ranks >= 2 workers."""

from __future__ import annotations

import logging

from tilegraph._errors import TileError


def initialize_mpi(interface: str | None = None, quiet: bool = True) -> int:
    """Turn this MPI rank into its dask-mpi role; on the client rank, return the worker count."""
    try:
        from dask_mpi import initialize
        from mpi4py import MPI
    except ImportError as e:
        raise TileError("tilegraph.connect(mpi=True)", "needs the mpi extra: pip install 'tilegraph[mpi]'",
                        f"ImportError: {e}") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 3:
        raise TileError("tilegraph.connect(mpi=True)", "dask-mpi needs at least 3 ranks (scheduler, client, "
                        "one worker): mpiexec -n 3 or more", f"{comm.Get_size()} ranks")
    from tilegraph._runtime import _quiet_logs, _visible_gpus

    if quiet:  # dask-mpi ranks log connection noise (CommClosedError) at a clean shutdown
        _quiet_logs()
        if comm.Get_rank() != 1:  # scheduler and workers: their comms close under them at exit
            for name in ("distributed.batched", "distributed.core", "distributed.worker"):
                logging.getLogger(name).setLevel(logging.CRITICAL)

    # Per-rank worker options are decided here, before initialize() turns this rank into a worker.
    gpus = _visible_gpus()
    options = {"resources": {"GPU": 1} if gpus else {"CPU": 1}}
    initialize(interface=interface, nthreads=1, worker_options=options, dashboard=comm.Get_rank() == 0,
               exit=True)
    return comm.Get_size() - 2
