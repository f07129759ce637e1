"""Worker side: the programs that fused tasks run, and the runner that spreads a task's kernel
calls over its worker's threads. Nothing here builds graphs or talks to the scheduler."""


def setup_plugin(plugin_name: str, install):
    """A Dask worker plugin named ``plugin_name`` calling ``install(worker)`` on every worker of
    the cluster, also those joining later (idempotent: registered again, it changes nothing)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class SetupPlugin(WorkerPlugin):
        name = plugin_name
        idempotent = True

        def setup(self, worker) -> None:
            install(worker)

    return SetupPlugin()
