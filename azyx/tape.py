"""GradientTape: records the nodes built inside its `with` block; while the tape object is alive, those nodes
keep their sources even after they are realized, so a backward pass can walk them (the autograd issue)."""

from __future__ import annotations

from azyx.runtime import GRAPH


class GradientTape:
    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self.ids: set[int] = set()
        GRAPH.tapes.add(self)

    def __enter__(self) -> GradientTape:
        GRAPH.recording.append(self.ids)
        return self

    def __exit__(self, *exc: object) -> None:
        GRAPH.recording.remove(self.ids)
