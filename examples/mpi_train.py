"""Train on a Dask cluster launched by MPI: rank 0 runs the scheduler, rank 1 this script (the
client), every further rank a worker (a GPU worker where a GPU is visible).

    pip install -e ".[mpi]"
    mpiexec -n 4 python examples/mpi_train.py --steps 50

Each rank may live on another node; nothing else needs to be started.
"""

import argparse

import numpy as np

import tilegraph as tg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--interface", default=None, help="network interface of the ranks, e.g. ib0 or lo")
    args = ap.parse_args()
    rt = tg.connect(mpi=True, interface=args.interface)  # only rank 1 returns from here; other ranks serve and exit
    try:
        n = len(rt.workers())
        print(f"tilegraph: {n} MPI worker{'' if n == 1 else 's'}, processors {rt.processors()}", flush=True)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((256, 32)).astype(np.float32)
        y = np.tanh(x @ rng.standard_normal((32, 4)).astype(np.float32) / 6)
        model = tg.nn.MLP(32, 64, out_dim=4, tile=16, seed=0)
        opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-2, 5, args.steps))

        def loss_fn(m, x, y):
            d = m(x) - y
            return (d * d).mean()

        step = tg.TrainStep(model, opt, loss_fn, batch_tiles=[(64, 16), (64, None)], runtime=rt)
        losses = [step(x, y) for _ in range(args.steps)]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
