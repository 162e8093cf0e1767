"""``AskAhead``: a sampler wrapper that, as the DataLoader draws indices, hints the dataset's
files of the next ones (``dataset.want(indices)``), so a copy still being staged copies them
before the job's workers ask.  No torch import: a sampler is any iterable with a length."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any


class AskAhead:
    """Yields ``sampler``'s indices unchanged, drawing ``ahead`` of them early and passing
    each newly drawn run to ``want`` (in the main process: the workers' own reads then find
    the files landed, or their demands answered at once).  ``step``: how many are drawn at a
    time (one hint per step, not per index)."""

    def __init__(
        self, sampler: Iterable[Any], want: Callable[[list[Any]], None], ahead: int, step: int = 1
    ) -> None:
        self.sampler = sampler
        self.want = want
        self.step = max(1, step)
        self.ahead = max(ahead, self.step)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.sampler)
        drawn: deque[Any] = deque()
        more = True
        while True:
            if more and len(drawn) <= self.ahead - self.step:
                new = list(islice(source, self.ahead - len(drawn)))
                more = len(new) == self.ahead - len(drawn)
                if new:
                    self.want(new)
                    drawn.extend(new)
            if not drawn:
                return
            yield drawn.popleft()
