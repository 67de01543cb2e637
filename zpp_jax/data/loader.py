"""Batches onto the mesh: each process reads only its own rows of the global
batch, `grain` threads read ahead of the step."""

from __future__ import annotations

import jax
import numpy as np

from zpp_jax.data.dataset import TokenDataset


def local_rows(sharding, shape: tuple[int, ...]) -> list[int]:
    """The rows of a global array of `shape` that this process's devices
    hold under `sharding` (all of them in one process)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    return sorted(rows)


def host_to_global(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Global arrays from host arrays of the global shape: each process
    copies only the rows of its own devices (the others may be anything).
    Works in one process and under `jax.distributed` alike."""
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in batch.items()
    }


class BatchLoader:
    """Batches `start`, `start` + 1, ... (up to `stop`) of a split of
    `dataset`, as global arrays laid out by `sharding`.

    Guarantees: batch i is `dataset.batch(split, i, batch_size, seed)`, the
    same in any number of processes; this process reads only `rows`, the
    rows its devices hold. Costs: `threads` grain threads read ahead, at
    most `prefetch` batches of this process's rows are held in host memory.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        split: str,
        batch_size: int,
        seed: int,
        sharding,
        start: int = 0,
        stop: int | None = None,
        threads: int = 2,
        prefetch: int = 4,
    ) -> None:
        import grain

        self.sharding = sharding
        self.rows = local_rows(sharding, (batch_size, dataset.seq_len))

        def read(index: int) -> dict[str, np.ndarray]:
            return dataset.batch(split, index, batch_size, seed, rows=self.rows)

        stop = start + (1 << 40) if stop is None else stop
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        self._batches = iter(grain.MapDataset.range(start, stop).map(read).to_iter_dataset(options))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return host_to_global(next(self._batches), self.sharding)
