"""Worker side: the programs that fused tasks run, and the runner that spreads a task's kernel
calls over its worker's threads. Nothing here builds graphs or talks to the scheduler."""


def setup_plugin(plugin_name: str, install, teardown=None):
    """A Dask worker plugin named ``plugin_name`` calling ``install(worker)`` on every worker of
    the cluster, also those joining later (idempotent: registered again, it changes nothing),
    and ``teardown(worker)``, if given, as a worker closes."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class SetupPlugin(WorkerPlugin):
        name = plugin_name
        idempotent = True

        def setup(self, worker) -> None:
            install(worker)

        def teardown(self, worker) -> None:
            if teardown is not None:
                teardown(worker)

    return SetupPlugin()
