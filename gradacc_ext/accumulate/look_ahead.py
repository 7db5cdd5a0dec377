"""GradientAccumulator.iterate(): the loader's batches, fetched one ahead (Accelerate's end_of_dataloader).

Knowing, while the loader's last batch runs, that it is the last lets its micro-step close the window as
micro_step(last=True) does, so the short last window needs no flush().
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

_END = object()  # past the loader's last batch


class LoaderLookAhead:
    """Yields a loader's batches one behind the fetch; `ends` is True while the batch last yielded is its last."""

    def __init__(self) -> None:
        self.ends = False

    def iterate(self, loader: Iterable) -> Iterator[Any]:
        try:
            batches = iter(loader)  # here, not in the generator: a bad loader fails at the call that passed it
        except TypeError:
            raise TypeError(
                f"GradientAccumulator.iterate: loader must be an iterable of batches (a DataLoader, a list), "
                f"got {type(loader).__name__}"
            ) from None
        return self._look_ahead(batches)

    def _look_ahead(self, batches: Iterator[Any]) -> Iterator[Any]:
        ahead = next(batches, _END)
        try:
            while ahead is not _END:
                batch, ahead = ahead, next(batches, _END)
                self.ends = ahead is _END
                yield batch
        finally:
            self.ends = False
