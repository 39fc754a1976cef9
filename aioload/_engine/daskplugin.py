"""``executor=`` on a Dask cluster: the dataset reaches each worker process once, as a worker plugin.

Sent with each task, a 50 MiB dataset travelled once per task in flight (each copy a "large
graph" warning); sent on demand, each new process would cost a round trip. A registered
plugin is sent by the scheduler to every worker once, also to workers that join later (a
worker that a nanny restarts); its ``setup`` installs the dataset there
(:func:`aioload._engine.executor_process.install`: torch's ``WorkerInfo``, the seeds, ``worker_init_fn``),
and ``teardown`` -- when the loader closes and unregisters it -- drops it. Imported only where
Dask is in use (the workers import it to unpickle the plugin).
"""

from __future__ import annotations

from distributed.diagnostics.plugin import WorkerPlugin

from aioload._engine import executor_process as _executor


class DatasetPlugin(WorkerPlugin):
    """One loader's dataset (pickled by the loader: ``blob``) for every worker of the cluster.

    A worker's ``get_worker_info().id`` is its Dask ``name`` when that is a number (as
    ``LocalCluster`` and ``dask worker --name N`` give), else its place among the cluster's
    workers (by address) when its copy arrived; ``num_workers`` is the number of workers then."""

    idempotent = False

    def __init__(self, token: str, blob: bytes, base_seed: int):
        self.token = token
        self.blob = blob
        self.base_seed = base_seed
        self.failed: bytes | None = None  # worker_init_fn's error in this worker, for the tasks to report

    async def setup(self, worker) -> None:
        identity = await worker.scheduler.identity()
        addresses = sorted(identity.get("workers", {}))
        name = worker.name
        if isinstance(name, int) and not isinstance(name, bool) and name >= 0:
            wid = name
        else:
            wid = addresses.index(worker.address) if worker.address in addresses else len(addresses)
        init = (wid, len(addresses), self.base_seed)
        try:
            _executor.install(self.token, self.blob, init)
        except _executor._InitFailed as failed:
            _executor.remember_init_failure(self.token, failed.packed)
        self.blob = b""  # installed: this worker's plugin need not keep the bytes

    def teardown(self, worker) -> None:
        _executor.forget(self.token)
